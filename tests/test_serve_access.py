"""Who may call the server and how much it gives (serve/access.py, serve/keepalive.py), over real HTTP on
127.0.0.1 with tiny models: API keys (401 without, 200 with; /health open), CORS headers, HTTPS with
uvicorn's TLS files, the server-wide max_tokens cap, `n` taking n places in the queue, and the SSE
keep-alive comment while a stream waits."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from serving import WAIT_S, GatedEngine, expect, serving, url_of, wait_for
from typer.testing import CliRunner

from draftverify import DraftVerifyError, Engine
from draftverify.serve import ServeConfig, Server, create_app, parse_methods
from draftverify.serve.access import check_tls, key_matches, read_keys
from draftverify.serve.keepalive import COMMENT

KEYS = ("key-one", "key-two")
ORIGIN = "https://ui.example"
CAP = 5


@pytest.fixture(scope="module")
def keyed(models):
    with serving(Engine(*models), api_keys=KEYS, cors_origins=(ORIGIN,), max_tokens=CAP) as (client, _):
        yield client


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_api_key_401_without_200_with_and_health_open(keyed):
    body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
    for headers in (
        {},
        bearer("wrong"),
        {"Authorization": "Basic key-one"},
        bearer("key-one" + "x"),
        {"Authorization": "Bearer"},
    ):
        r = keyed.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (headers, r.text)
        assert r.headers["WWW-Authenticate"] == "Bearer"
    for path in ("/v1/models", "/metrics", "/props", "/nowhere"):
        assert keyed.get(path).status_code == 401, path
    for key in KEYS:
        assert keyed.post("/v1/completions", json=body, headers=bearer(key)).status_code == 200
    assert keyed.get("/health").status_code == 200  # probes need no secret
    assert keyed.get("/v1/models", headers=bearer("key-two")).status_code == 200
    metrics = keyed.get("/metrics", headers=bearer("key-one")).text
    assert 'draftverify_requests_total{route="/v1/completions",status="401"} 5' in metrics


def test_openai_client_sends_its_api_key(keyed):
    base = f"{url_of(keyed)}/v1"
    good = openai.OpenAI(base_url=base, api_key="key-one", max_retries=0, timeout=WAIT_S)
    assert good.completions.create(model=None, prompt="Hi", max_tokens=2, temperature=0).choices[0].text
    bad = openai.OpenAI(base_url=base, api_key="nope", max_retries=0, timeout=WAIT_S)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_key_compare_takes_every_key():
    assert key_matches("Bearer b", ("a", "b")) and key_matches("bearer a", ("a", "b"))
    assert not key_matches("Bearer ab", ("a", "b")) and not key_matches("b", ("a", "b"))


def test_cors_preflight_and_headers_on_answers_and_401s(keyed):
    asked = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    r = keyed.options(
        "/v1/chat/completions", headers={**asked, "Access-Control-Request-Headers": "authorization,content-type"}
    )
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN  # no key on a preflight
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = keyed.get("/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN  # the page can read the 401
    r = keyed.get("/v1/models", headers={"Origin": ORIGIN, **bearer("key-one")})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = keyed.get("/v1/models", headers={"Origin": "https://evil.example", **bearer("key-one")})
    assert "access-control-allow-origin" not in r.headers


def test_max_tokens_cap_clamps_every_request(keyed, offline):
    want = expect(offline, "Hello", max_new_tokens=CAP, temperature=0.0)
    assert len(want.tokens) == CAP and want.stats.finish_reason == "length"  # else the cap could not show
    for asked in ({"max_tokens": 50}, {}, {"max_tokens": CAP}):
        r = keyed.post(
            "/v1/completions", json={"prompt": "Hello", "temperature": 0, **asked}, headers=bearer("key-one")
        )
        out = r.json()
        assert out["choices"][0]["text"] == want.text and out["usage"]["completion_tokens"] == CAP, asked
        assert out["choices"][0]["finish_reason"] == "length"
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 40, "temperature": 0}
    r = keyed.post("/v1/chat/completions", json=chat, headers=bearer("key-two"))
    assert r.json()["usage"]["completion_tokens"] <= CAP
    r = keyed.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, headers=bearer("key-one"))
    assert r.json()["usage"]["completion_tokens"] == 2  # a smaller ask stays as asked


def test_n_takes_n_places_in_the_queue(models):
    engine = GatedEngine(*models)
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0}
    with serving(engine, max_queue=4, max_batch=1) as (client, _), ThreadPoolExecutor(3) as pool:
        engine.gate.clear()
        post = lambda **extra: pool.submit(httpx.post, url_of(client) + "/v1/completions", json={**body, **extra})  # noqa: E731
        held = [post()]
        wait_for(lambda: client.get("/health").json()["busy"])
        held.append(post())
        wait_for(lambda: client.get("/health").json()["queue_depth"] == 1)
        r = client.post("/v1/completions", json={**body, "n": 4})  # 1 waiting + 4 > 4 places
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full" and "Retry-After" in r.headers
        held.append(post(n=3))  # 1 + 3 fit
        wait_for(lambda: client.get("/health").json()["queue_depth"] == 4)
        assert client.post("/v1/completions", json=body).status_code == 429  # the line is full: one more is too many
        engine.gate.set()
        answers = [f.result(WAIT_S) for f in held]
    assert [r.status_code for r in answers] == [200, 200, 200] and len(answers[2].json()["choices"]) == 3


def test_keep_alive_comments_while_a_stream_waits(models, offline):
    engine = GatedEngine(*models)
    want = expect(offline, "Hello", max_new_tokens=4, temperature=0.0).text
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "stream": True}
    with serving(engine, keep_alive_s=0.05) as (client, _):
        engine.gate.clear()
        threading.Timer(WAIT_S / 4, engine.gate.set).start()  # without comments the stream still ends, and fails
        lines = []
        with client.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                lines.append(line)
                if line == COMMENT.strip() and lines.count(line) == 3:
                    engine.gate.set()  # three comments while held: now let it run
        assert lines.count(": keep-alive") >= 3
        data = [line[6:] for line in lines if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        text = "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1])
        assert text == want
    with serving(engine) as (client, _):  # the default interval: a short stream has no comment
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert ": keep-alive" not in list(r.iter_lines())


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_tls_serves_https(models, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    app = create_app(Engine(*models), ServeConfig(methods=parse_methods("autoregressive")))
    server = Server(app, port=0, log_level="warning", ssl_certfile=str(cert), ssl_keyfile=str(key))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started)
        url, trust = f"127.0.0.1:{server.port}", ssl.create_default_context(cafile=str(cert))
        r = httpx.post(f"https://{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, verify=trust)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://{url}/health", timeout=5)  # plain HTTP is not spoken there
    finally:
        server.should_exit = True
        thread.join(WAIT_S)


def test_bad_access_settings_are_refused_in_one_line(models, tmp_path):
    for fields, message in (
        ({"max_tokens": 0}, "max_tokens=0 must be at least 1"),
        ({"keep_alive_s": -1}, "keep_alive=-1 must be at least 0"),
        ({"cors_origins": ("ui.example",)}, "is not an origin"),
        ({"api_keys": ("two words",)}, "holds whitespace"),
    ):
        with pytest.raises(DraftVerifyError, match=message):
            ServeConfig(**fields)
    keys = tmp_path / "keys"
    keys.write_text("# ours\nalpha\n\n  beta \n")
    assert read_keys(["gamma"], keys) == ("gamma", "alpha", "beta")
    keys.write_text("# none\n")
    with pytest.raises(DraftVerifyError, match="holds no key"):
        read_keys([], keys)
    with pytest.raises(DraftVerifyError, match="needs both --ssl-certfile and --ssl-keyfile"):
        check_tls(keys, None)
    with pytest.raises(DraftVerifyError, match="does not exist"):
        check_tls(keys, tmp_path / "missing.pem")


def test_cli_refuses_half_tls_before_loading():
    from draftverify.cli import app

    result = CliRunner().invoke(app, ["serve", "--ssl-certfile", "cert.pem", "--methods", "autoregressive"])
    assert isinstance(result.exception, DraftVerifyError) and "--ssl-keyfile" in str(result.exception)
    help_text = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}).output
    for option in ("--api-key", "--api-key-file", "--ssl-certfile", "--cors-origin", "--max-tokens", "--strict"):
        assert option in help_text, option
