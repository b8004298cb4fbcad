"""The server surface clients reach for beyond chat and completions: CORS, /version, /ping."""

import pytest

from asyncllm import AsyncLLM, __version__
from asyncllm.errors import ConfigError
from asyncllm.server import create_app
from server_helpers import request

PREFLIGHT = {"Origin": "https://app.example.com", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


@pytest.fixture(scope="module")
def llm(model_dirs):
    llm = AsyncLLM(str(model_dirs["llama"]), dtype="float32")
    yield llm
    llm.close()


def test_cors_preflight_from_an_allowed_origin(llm):
    app = create_app(llm, api_key="k", allowed_origins=["https://app.example.com"])
    response = request(app, "OPTIONS", "/v1/chat/completions", headers=PREFLIGHT)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "https://app.example.com"
    assert "POST" in response.headers["access-control-allow-methods"]
    other = request(app, "OPTIONS", "/v1/chat/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    answer = request(app, "POST", "/v1/chat/completions", json=body,
                     headers={"Origin": "https://app.example.com", "Authorization": "Bearer k"})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "https://app.example.com"


def test_no_cors_unless_asked_and_bad_origins_refused(llm):
    assert request(create_app(llm), "OPTIONS", "/v1/chat/completions", headers=PREFLIGHT).status_code == 405
    any_origin = create_app(llm, allowed_origins=["*"])
    response = request(any_origin, "OPTIONS", "/v1/models", headers={**PREFLIGHT, "Origin": "http://localhost:3000"})
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == "*"
    for bad in (["app.example.com"], ["https://app.example.com/"], [3]):
        with pytest.raises(ConfigError, match="allowed_origins"):
            create_app(llm, allowed_origins=bad)


def test_version_and_ping(llm):
    app = create_app(llm, api_key="k")  # both answer without the key, like /health
    assert request(app, "GET", "/version").json() == {"version": __version__}
    assert request(app, "GET", "/ping").status_code == 200


def test_serve_allowed_origins_flag():
    from asyncllm.cli import build_parser
    from asyncllm.server.serve import _origins

    args = build_parser().parse_args(["serve", "m", "--allowed-origins", "https://a.example,https://b.example",
                                      "--allowed-origins", "http://localhost:3000"])
    assert _origins(args.allowed_origins) == ["https://a.example", "https://b.example", "http://localhost:3000"]
    assert _origins(build_parser().parse_args(["serve", "m"]).allowed_origins) is None
