"""An OpenAI-compatible HTTP server for any draftverify method (`draftverify serve`).

    from draftverify import Engine
    from draftverify.serve import ServeConfig, Server, create_app, parse_methods

    app = create_app(Engine.load(), ServeConfig(methods=parse_methods("speculative,autoregressive")))
    Server(app, port=8000).run()

Needs the `serve` extra: `pip install 'draftverify[serve]'` (FastAPI, uvicorn, httpx). The names
are imported on first use, so that `draftverify --help` does not load FastAPI.
"""

_EXPORTS = {"MethodSpec": "app", "ServeConfig": "app", "create_app": "app", "parse_methods": "app", "Server": "server"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'draftverify.serve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"draftverify.serve.{_EXPORTS[name]}"), name)
