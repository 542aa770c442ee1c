"""API keys, JWT and the auth config file (issue 12, item 1), without a server."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from pdserve.core.errors import ErrorCode
from pdserve.frontends.traffic.apis import parse_restricted
from pdserve.frontends.traffic.auth import (
    AuthConfigError,
    Authenticator,
    AuthError,
    bearer_token,
    load_auth_config,
)
from pdserve.frontends.traffic.gate import TrafficGate
from tests.traffic_keys import scrypt_hash, sha256_hash, token, write_jwks

KEY_A = "key-a-0123456789"
KEY_OPS = "ops-key-abcdef"


def write_config(tmp_path: Path, extra: str = "", jwt: bool = True) -> Path:
    write_jwks(tmp_path / "jwks.json")
    jwt_section = (
        """
jwt:
  jwks_file: jwks.json
  audience: pdserve
  issuer: https://idp.test/
  leeway_secs: 5
  algorithms: [RS256]
"""
        if jwt
        else ""
    )
    path = tmp_path / "auth.yaml"
    path.write_text(
        f"""
keys:
  - name: team-a
    hash: {sha256_hash(KEY_A)}
    models: ["tiny*"]
  - name: ops
    hash: {scrypt_hash(KEY_OPS)}
    apis: ["*"]
    rate_limit: 100/second
  - name: from-env
    env: TEST_PDSERVE_KEY
{jwt_section}
{extra}
"""
    )
    return path


ENV = {"TEST_PDSERVE_KEY": "env-key-xyz"}


def auth_of(tmp_path: Path, extra: str = "") -> Authenticator:
    return Authenticator(load_auth_config(write_config(tmp_path, extra), env=ENV))


def refused(auth: Authenticator, tok: str | None) -> AuthError:
    with pytest.raises(AuthError) as e:
        auth.authenticate(tok)
    return e.value


def test_api_keys_sha256_scrypt_and_env(tmp_path: Path) -> None:
    auth = auth_of(tmp_path)
    a = auth.authenticate(KEY_A)
    assert (a.name, a.models, sorted(a.apis)) == ("team-a", ("tiny*",), ["inference", "metadata"])
    assert a.may_use_model("tiny") and a.may_use_model("tiny_specific")
    assert not a.may_use_model("minilm")
    ops = auth.authenticate(KEY_OPS)
    assert ops.name == "ops" and "model-repository" in ops.apis and ops.rate_limit == "100/second"
    assert auth.authenticate(KEY_OPS) is ops  # the scrypt result is remembered
    assert auth.authenticate("env-key-xyz").name == "from-env"
    e = refused(auth, "not-a-key")
    assert (e.code, e.why) == (ErrorCode.UNAUTHENTICATED, "unknown_key")
    assert "not-a-key" not in e.message
    e = refused(auth, None)
    assert (e.code, e.why) == (ErrorCode.UNAUTHENTICATED, "missing")
    assert e.http_headers == [(b"www-authenticate", b'Bearer realm="pdserve"')]


def test_jwt_valid_and_every_way_it_fails(tmp_path: Path) -> None:
    auth = auth_of(tmp_path)
    p = auth.authenticate(token(models=["tiny"], apis=["inference"]))
    assert (p.name, p.kind, p.models, p.apis) == (
        "alice",
        "jwt",
        ("tiny",),
        frozenset({"inference"}),
    )
    cases = {
        "expired": token(exp_in=-60),
        "wrong_audience": token(aud="someone-else"),
        "wrong_issuer": token(iss="https://evil.test/"),
        "bad_signature": token(other_key=True),
        "unknown_key": token(kid="nobody"),
        "malformed": "abc.def.ghi",
        "invalid_token": token(aud=None),  # audience configured: a token without aud
    }
    for why, tok in cases.items():
        e = refused(auth, tok)
        assert (e.code, e.why) == (ErrorCode.UNAUTHENTICATED, why), why
        assert tok not in e.message
    # within the configured clock skew (5 s) an expired token still passes
    assert auth.authenticate(token(exp_in=-2)).name == "alice"


def test_jwt_alg_none_is_refused(tmp_path: Path) -> None:
    import jwt

    auth = auth_of(tmp_path)
    unsigned = jwt.encode(
        {"sub": "x", "exp": 9999999999, "aud": "pdserve", "iss": "https://idp.test/"},
        None,
        algorithm="none",
        headers={"kid": "test-key-1"},
    )
    assert refused(auth, unsigned).code is ErrorCode.UNAUTHENTICATED


def test_bearer_header_forms() -> None:
    assert bearer_token("Bearer abc", None) == "abc"
    assert bearer_token("bearer  abc ", None) == "abc"
    assert bearer_token(None, "tok") == "tok"
    assert bearer_token(None, None) is None
    for bad in ("Basic abc", "Bearer", "Bearer a b", "abc"):
        with pytest.raises(AuthError) as e:
            bearer_token(bad, None)
        assert e.value.why == "malformed"


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ("keys: [", "not valid YAML/JSON"),
        ("- a\n- b\n", "top level must be a mapping"),
        ("users: []\n", "unknown section"),
        ("keys:\n  - name: x\n    hash: md5:abc\n", "'hash' must be sha256"),
        ("keys:\n  - name: x\n    hash: sha256:abcd\n", "'hash' must be sha256"),
        ("keys:\n  - name: x\n", "exactly one of 'hash' and 'env'"),
        ("keys:\n  - name: x\n    env: NOT_SET_ANYWHERE_123\n", "is not set"),
        ("keys:\n  - hash: sha256:" + "0" * 64 + "\n", "'name' must be"),
        (
            "keys:\n  - name: x\n    hash: sha256:" + "0" * 64 + "\n    apis: [admin]\n",
            "unknown API",
        ),
        (
            "keys:\n  - name: x\n    hash: sha256:" + "0" * 64 + "\n    rate_limit: lots\n",
            "bad rate limit",
        ),
        ("jwt:\n  audience: a\n", "jwks_file must name"),
        ("jwt:\n  jwks_file: missing.json\n", "JWKS file .*missing.json"),
        ("jwt:\n  jwks_file: bad.json\n", "not a usable JWK set"),
        ("jwt:\n  jwks_file: jwks.json\n  algorithms: [none]\n", "must not include 'none'"),
    ],
)
def test_bad_config_files_are_clear_errors(tmp_path: Path, body: str, match: str) -> None:
    write_jwks(tmp_path / "jwks.json")
    (tmp_path / "bad.json").write_text("{not json")
    path = tmp_path / "auth.yaml"
    path.write_text(body)
    with pytest.raises(AuthConfigError, match=match):
        load_auth_config(path, env={})


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(AuthConfigError, match="cannot read"):
        load_auth_config(tmp_path / "nope.yaml")


def test_json_config_file(tmp_path: Path) -> None:
    path = tmp_path / "auth.json"
    path.write_text(json.dumps({"keys": [{"name": "j", "hash": sha256_hash("k")}]}))
    assert Authenticator(load_auth_config(path)).authenticate("k").name == "j"


def headers(d: dict[str, str]):  # noqa: ANN201 - test helper
    return lambda name: d.get(name)


def check(
    gate: TrafficGate, category: str, model: str, hdrs: dict[str, str], protocol: str = "http"
):  # noqa: ANN201
    return asyncio.run(gate.check(protocol, category, model, headers(hdrs)))


def test_gate_grants_health_restricted_and_failure_counts(tmp_path: Path) -> None:
    cfg = load_auth_config(write_config(tmp_path), env=ENV)
    gate = TrafficGate(
        cfg,
        http_restricted=parse_restricted(["statistics:admin-key=open-sesame"], "--h"),
        grpc_restricted=parse_restricted(["statistics:admin-key=open-sesame"], "--g"),
    )
    assert check(gate, "health", "", {}).name == ""  # health: always open
    bearer = {"authorization": f"Bearer {KEY_A}"}
    assert check(gate, "inference", "tiny", bearer).name == "team-a"
    assert check(gate, "inference", "tiny", {"triton-access-token": KEY_A}).name == "team-a"
    with pytest.raises(AuthError) as e:
        check(gate, "inference", "minilm", bearer)
    assert (e.value.code, e.value.why) == (ErrorCode.PERMISSION_DENIED, "forbidden_model")
    with pytest.raises(AuthError) as e:
        check(gate, "model-repository", "", bearer)
    assert (e.value.code, e.value.why) == (ErrorCode.PERMISSION_DENIED, "forbidden_api")
    ops = {"authorization": f"Bearer {KEY_OPS}"}
    with pytest.raises(AuthError) as e:
        check(gate, "statistics", "", ops)
    assert e.value.message == "This API is restricted, expecting header 'admin-key'"
    assert check(gate, "statistics", "", {**ops, "admin-key": "open-sesame"}).name == "ops"
    with pytest.raises(AuthError) as e:
        check(gate, "statistics", "", {**ops, "admin-key": "open-sesame"}, protocol="grpc")
    assert "triton-grpc-protocol-admin-key" in e.value.message
    grpc_hdrs = {**ops, "triton-grpc-protocol-admin-key": "open-sesame"}
    assert check(gate, "statistics", "", grpc_hdrs, protocol="grpc").name == "ops"
    with pytest.raises(AuthError):
        check(gate, "inference", "tiny", {})
    samples = {(s[0], s[3].get("protocol"), s[3].get("reason")): s[4] for s in gate.samples()}
    assert samples[("pdserve_auth_failures_total", "http", "forbidden_model")] == 1
    assert samples[("pdserve_auth_failures_total", "http", "restricted")] == 1
    assert samples[("pdserve_auth_failures_total", "grpc", "restricted")] == 1
    assert samples[("pdserve_auth_failures_total", "http", "missing")] == 1
    for s in gate.samples():
        assert KEY_A not in str(s) and KEY_OPS not in str(s)


def test_anonymous_grants(tmp_path: Path) -> None:
    extra = "anonymous:\n  models: [tiny]\n  apis: [metadata]\n"
    gate = TrafficGate(load_auth_config(write_config(tmp_path, extra), env=ENV))
    assert check(gate, "metadata", "tiny", {}).name == "anonymous"
    with pytest.raises(AuthError) as e:
        check(gate, "inference", "tiny", {})
    assert e.value.code is ErrorCode.PERMISSION_DENIED


def test_reload_keeps_the_last_good_config(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TEST_PDSERVE_KEY", "env-key-xyz")
    path = write_config(tmp_path)
    gate = TrafficGate(load_auth_config(path))
    bearer = {"authorization": f"Bearer {KEY_A}"}
    assert check(gate, "inference", "tiny", bearer).name == "team-a"
    caplog.set_level(logging.INFO, "pdserve.auth")
    # a corrupt JWKS file at reload: the old keys stay
    (tmp_path / "jwks.json").write_text("{broken")
    assert gate.changed()
    assert gate.reload() is False
    assert "not reloaded" in caplog.text and "the previous one stays" in caplog.text
    assert check(gate, "inference", "tiny", bearer).name == "team-a"
    assert check(gate, "inference", "tiny", {"authorization": f"Bearer {token()}"}).name == "alice"
    # the JWKS file removed: same
    (tmp_path / "jwks.json").unlink()
    assert gate.reload() is False
    # a good file: the new keys
    write_jwks(tmp_path / "jwks.json")
    path.write_text(f"keys:\n  - name: team-b\n    hash: {sha256_hash('key-b')}\n")
    assert gate.reload() is True
    assert check(gate, "inference", "tiny", {"authorization": "Bearer key-b"}).name == "team-b"
    with pytest.raises(AuthError):
        check(gate, "inference", "tiny", bearer)
    assert gate.reloads == {"ok": 1, "failed": 2}
    assert KEY_A not in caplog.text and "key-b" not in caplog.text


def test_the_deploy_example_config_loads() -> None:
    root = Path(__file__).resolve().parents[4] / "deploy" / "traffic-control"
    cfg = load_auth_config(root / "auth.yaml", env={"PDSERVE_OPS_KEY": "ops"})
    assert [k.principal.name for k in cfg.keys] == ["search-team", "vision-team", "platform-ops"]
    assert cfg.jwt is not None and cfg.jwt.audience == "pdserve"
    assert Authenticator(cfg).authenticate("ops").apis >= {"model-repository", "logging"}


def test_a_reload_may_add_keys_and_limits(tmp_path: Path) -> None:
    from pdserve.frontends.traffic.ratelimit import RateLimiter, RateLimitExceededError

    path = tmp_path / "auth.yaml"
    path.write_text("{}\n")  # nothing yet: every request passes
    cfg = load_auth_config(path)
    gate = TrafficGate(cfg, RateLimiter(cfg.rate_limits))
    assert gate.active  # a config is given: a reload may add anything
    assert check(gate, "inference", "tiny", {}).name == ""
    path.write_text(
        f"keys:\n  - name: k\n    hash: {sha256_hash('the-key')}\n    rate_limit: 1/hour\n"
        "rate_limits:\n  models:\n    tiny: 5/hour\n"
    )
    assert gate.reload() is True
    with pytest.raises(AuthError):
        check(gate, "inference", "tiny", {})
    hdrs = {"authorization": "Bearer the-key"}
    assert check(gate, "inference", "tiny", hdrs).name == "k"
    with pytest.raises(RateLimitExceededError):
        check(gate, "inference", "tiny", hdrs)
