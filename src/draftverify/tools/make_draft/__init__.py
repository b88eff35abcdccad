"""`draftverify make-draft`: a small draft model for any target, distilled from it (see build.py)."""
