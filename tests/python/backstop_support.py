"""Shared helpers for the Backstop end-to-end tests (imported by conftest and the tests).

Nothing here starts processes; see conftest.py for the session fixture.
"""

from __future__ import annotations

import json
import re
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The openai / anthropic SDKs ship either `httpx` or its successor `httpx2`
# (openai>=3 / anthropic>=2 depend on `httpx2`). Use whichever is installed, so
# that the raw-HTTP tests speak the same client stack as the SDKs.
try:  # pragma: no cover - depends on the installed SDK generation
    import httpx2 as httpx  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover
    import httpx  # type: ignore[no-redef]

__all__ = [
    "httpx",
    "TENANT_A_KEY",
    "TENANT_B_KEY",
    "PROVIDER_OPENAI_KEY",
    "PROVIDER_ANTHROPIC_KEY",
    "MAX_BODY_BYTES",
    "Backstop",
    "free_port",
    "scenario_name",
    "assert_openai_error",
    "assert_anthropic_error",
    "assert_no_tenant_key",
]

TENANT_A_KEY = "bk-test-a"
TENANT_B_KEY = "bk-test-b"
CAPPED_KEY = "bk-test-capped"
THROTTLED_KEY = "bk-test-throttled"
GUARDED_KEY = "bk-test-guarded"
GUIDED_KEY = "bk-test-guided"
FLEET_KEY = "bk-test-fleet"
BILLED_KEY = "bk-test-billed"
# Side effects committed once (tests/python/test_side_effects_sdk.py): one tenant per
# `on_repeat`.
EFFECTS_KEY = "bk-test-effects"
EFFECTS_REFUSE_KEY = "bk-test-effects-refuse"
EFFECTS_ANNOTATE_KEY = "bk-test-effects-annotate"
EFFECTS_RESTORE_KEY = "bk-test-effects-restore"
ADMIN_TOKEN = "admin-test-token-0123456789"
PROVIDER_OPENAI_KEY = "sk-provider-openai"
PROVIDER_ANTHROPIC_KEY = "sk-provider-anthropic"
MAX_BODY_BYTES = 65536

# Models that appear literally (no wildcard) in the routes of the test config.
EXACT_ROUTE_MODELS = ["quota-gpt", "storm-gpt", "storm-claude", "rewrite-me", "dead-model", "dead-claude", "slow-model", "slow-claude"]
WILDCARD_ROUTE_MODELS = ["gpt-*", "text-embedding-*", "claude-*"]


# The identities the mock's Bedrock accepts (src/mock/bedrock.rs).
BEDROCK_ACCESS_KEY_ID = "AKIAMOCKBEDROCK00001"
BEDROCK_SECRET_ACCESS_KEY = "mock/Bedrock+Secret/Access/Key0000000001"
BEDROCK_SESSION = {
    "AWS_ACCESS_KEY_ID": "ASIAMOCKBEDROCK00002",
    "AWS_SECRET_ACCESS_KEY": "mock/Bedrock+Session/Secret/Key000000002",
    "AWS_SESSION_TOKEN": "IQoJb3JpZ2luX2VjEMOCKSESSIONTOKEN//////////wEaCXVzLWVhc3QtMQ==",
}
BEDROCK_SONNET = "anthropic.claude-sonnet-4-5-20250929-v1:0"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind port 0, then close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scenario_name(nodeid: str) -> str:
    """A unique, header-safe mock scenario name derived from a pytest node id."""
    base = re.sub(r"[^A-Za-z0-9_.-]+", "-", nodeid.split("::")[-1]).strip("-")[:60]
    return f"{base}-{uuid.uuid4().hex[:8]}"


def render_config(*, port: int, mock_port: int, dead_port: int, store_path: str = ":memory:") -> str:
    mock = f"http://127.0.0.1:{mock_port}"
    dead = f"http://127.0.0.1:{dead_port}"
    return f"""\
[store]
path = "{store_path}"

[server]
listen = "127.0.0.1:{port}"
max_body_bytes = {MAX_BODY_BYTES}
request_timeout = "30s"
session_id_fields = ["metadata.session_id", "metadata.user_id"]

[log]
format = "json"
level = "warn"

# The operator API and dashboard (tests/python/test_dashboard.py).
[admin]
token = "{ADMIN_TOKEN}"

# Small delays keep the suite fast. One server is shared by every test, so breakers
# must not open across tests: the breaker lifecycle is tested in Rust, per gateway.
[retry]
max_attempts = 3
base_delay = "5ms"
max_delay = "20ms"
max_retry_after = "2s"
budget_floor = 100000

[breaker]
failure_threshold = 100000

# The stored-response routes (/v1/responses/{id}...) go to the mock with the provider key
# (the default would be the first openai upstream a route targets: quota-a).
[responses]
upstream = "mock-openai"

[[upstreams]]
name = "mock-openai"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "{mock}"
api_key = "{PROVIDER_OPENAI_KEY}"
attempt_timeout = "5s"

[[upstreams]]
name = "mock-anthropic"
api = "anthropic"
forward_headers = ["x-mock-*"]
base_url = "{mock}"
api_key = "{PROVIDER_ANTHROPIC_KEY}"
attempt_timeout = "5s"

[[upstreams]]
name = "dead"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "{dead}"
api_key = "x"
attempt_timeout = "2s"

[[upstreams]]
name = "dead-anthropic"
api = "anthropic"
forward_headers = ["x-mock-*"]
base_url = "{dead}"
api_key = "x"
attempt_timeout = "2s"

[[upstreams]]
name = "slow"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "{mock}"
api_key = "x"
attempt_timeout = "300ms"

[[upstreams]]
name = "slow-anthropic"
api = "anthropic"
forward_headers = ["x-mock-*"]
base_url = "{mock}"
api_key = "x"
attempt_timeout = "300ms"

# Restart smart's outage (tests/python/test_restart_sdk.py): opens after two failures,
# half-opens 600 ms later.
[[upstreams]]
name = "outage"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "{mock}"
[upstreams.retry]
max_attempts = 1
[upstreams.breaker]
failure_threshold = 2
open_for = "600ms"
open_min = "600ms"

[[upstreams]]
name = "storm-a"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "{mock}"
attempt_timeout = "5s"

[[upstreams]]
name = "storm-b"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "{mock}"
attempt_timeout = "5s"

[[upstreams]]
name = "storm-anthropic-a"
api = "anthropic"
forward_headers = ["x-mock-*"]
base_url = "{mock}"
attempt_timeout = "5s"

[[upstreams]]
name = "storm-anthropic-b"
api = "anthropic"
forward_headers = ["x-mock-*"]
base_url = "{mock}"
attempt_timeout = "5s"

# A quota fault opens a breaker at once, whatever the threshold: its own pair.
[[upstreams]]
name = "quota-a"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "{mock}"

[[upstreams]]
name = "quota-b"
api = "openai"
forward_headers = ["x-mock-*"]
base_url = "{mock}"

# Amazon Bedrock (tests/python/test_bedrock_sdk.py): the mock plays InvokeModel and
# checks every SigV4 signature. `bedrock-chain` names no keys: the standard AWS chain
# finds the session credentials conftest puts in the server's environment.
[[upstreams]]
name = "bedrock-chain"
api = "bedrock"
region = "us-east-1"
forward_headers = ["x-mock-*"]
base_url = "{mock}"
attempt_timeout = "5s"

[[upstreams]]
name = "bedrock-keys"
api = "bedrock"
region = "eu-central-1"
forward_headers = ["x-mock-*"]
base_url = "{mock}"
access_key_id = "{BEDROCK_ACCESS_KEY_ID}"
secret_access_key = "{BEDROCK_SECRET_ACCESS_KEY}"
attempt_timeout = "5s"

[[routes]]
model = "bedrock-claude"
targets = [{{ upstream = "bedrock-chain", model = "{BEDROCK_SONNET}", max_tokens = 1024 }}]

[[routes]]
model = "bedrock-keys-claude"
targets = [{{ upstream = "bedrock-keys", model = "us.anthropic.claude-3-5-haiku-20241022-v1:0", max_tokens = 1024 }}]

[[routes]]
model = "openai-then-bedrock"
targets = [{{ upstream = "dead" }}, {{ upstream = "bedrock-chain", model = "{BEDROCK_SONNET}", max_tokens = 1024 }}]

[[routes]]
model = "quota-gpt"
targets = [{{ upstream = "quota-a" }}, {{ upstream = "quota-b" }}]

# Two targets on the same mock: attempts are counted per scenario across both.
[[routes]]
model = "outage-gpt"
targets = [{{ upstream = "outage" }}]

[[routes]]
model = "storm-gpt"
targets = [{{ upstream = "storm-a" }}, {{ upstream = "storm-b" }}]

[[routes]]
model = "storm-claude"
targets = [{{ upstream = "storm-anthropic-a" }}, {{ upstream = "storm-anthropic-b" }}]

[[routes]]
model = "gpt-*"
models = ["gpt-4o", "gpt-4o-mini"]
targets = [{{ upstream = "mock-openai" }}]

[[routes]]
model = "rewrite-me"
targets = [{{ upstream = "mock-openai", model = "gpt-4o-mini" }}]

[[routes]]
model = "text-embedding-*"
models = ["text-embedding-3-small"]
targets = [{{ upstream = "mock-openai" }}]

[[routes]]
model = "claude-*"
models = ["claude-mock-1", "claude-mock-2"]
targets = [{{ upstream = "mock-anthropic" }}]

[[routes]]
model = "dead-model"
targets = [{{ upstream = "dead" }}]

# The strategy switch across providers (test_switch_sdk.py): the first target is down
# (nothing listens), the second speaks the other API.
[[routes]]
model = "switch-gpt"
targets = [{{ upstream = "dead" }}, {{ upstream = "mock-anthropic", model = "claude-switch", max_tokens = 1024 }}]

[[routes]]
model = "switch-claude"
targets = [{{ upstream = "dead-anthropic" }}, {{ upstream = "mock-openai", model = "gpt-switch" }}]

# One conversation, two providers: OpenAI while it is up (scripted per request), then Claude.
[[routes]]
model = "switch-live"
targets = [{{ upstream = "mock-openai" }}, {{ upstream = "mock-anthropic", model = "claude-switch", max_tokens = 1024 }}]

[[routes]]
model = "dead-claude"
targets = [{{ upstream = "dead-anthropic" }}]

[[routes]]
model = "slow-model"
targets = [{{ upstream = "slow" }}]

[[routes]]
model = "slow-claude"
targets = [{{ upstream = "slow-anthropic" }}]

[[tenants]]
name = "team-a"
api_keys = ["{TENANT_A_KEY}"]

[[tenants]]
name = "team-b"
api_keys = ["{TENANT_B_KEY}"]

[[tenants]]
name = "capped"
api_keys = ["{CAPPED_KEY}"]
[tenants.session]
max_calls = 2

[[tenants]]
name = "guarded"
api_keys = ["{GUARDED_KEY}"]
[tenants.guard]
max_consecutive_failures = 3

# Restart smart (tests/python/test_restart_sdk.py): a loop is guided once before it trips.
[[tenants]]
name = "guided"
api_keys = ["{GUIDED_KEY}"]
[tenants.guard]
guide = true
identical_request_limit = 2
tool_loop_limit = 3
max_consecutive_failures = 10

# Side effects committed once (tests/python/test_side_effects_sdk.py).
[[tenants]]
name = "effects"
api_keys = ["{EFFECTS_KEY}"]
[tenants.side_effects]
tools = ["send_email", "transfer_*"]

[[tenants]]
name = "effects-refuse"
api_keys = ["{EFFECTS_REFUSE_KEY}"]
[tenants.side_effects]
tools = ["send_email"]
on_repeat = "refuse"
record = "hash"

[[tenants]]
name = "effects-annotate"
api_keys = ["{EFFECTS_ANNOTATE_KEY}"]
[tenants.side_effects]
tools = ["send_email"]
on_repeat = "annotate"

[[tenants]]
name = "effects-restore"
api_keys = ["{EFFECTS_RESTORE_KEY}"]
[tenants.side_effects]
tools = ["send_email"]
restore = "note"

# A USD cap priced from the built-in catalog (tests/python/test_billing_sdk.py).
[[tenants]]
name = "billed"
api_keys = ["{BILLED_KEY}"]
[tenants.session]
max_usd = 1.0

[[tenants]]
name = "throttled"
api_keys = ["{THROTTLED_KEY}"]
requests_per_minute = 1

[[tenants]]
name = "fleet"
api_keys = ["{FLEET_KEY}"]
[tenants.guard]
[tenants.guard.fleet]
min_sessions = 3
min_failures = 2
preempt = true
"""


@dataclass
class Backstop:
    """Handle on the running gateway + mock upstream (yielded by the session fixture)."""

    binary: Path
    port: int
    mock_port: int
    dead_port: int
    config_path: Path
    server_log: Path
    mock_log: Path
    _http: Any = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def openai_base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def anthropic_base_url(self) -> str:
        return self.url

    @property
    def mock_url(self) -> str:
        return f"http://127.0.0.1:{self.mock_port}"

    @property
    def http(self):
        if self._http is None:
            self._http = httpx.Client(timeout=30.0)
        return self._http

    # --- mock upstream introspection -------------------------------------------------
    def mock_stats(self) -> dict:
        r = self.http.get(f"{self.mock_url}/mock/stats")
        assert r.status_code == 200, f"GET /mock/stats -> {r.status_code}: {r.text}"
        return r.json()

    def attempts(self, scenario: str) -> int:
        """How many requests the mock upstream received in `scenario`."""
        return int(self.mock_stats().get("scenarios", {}).get(scenario, 0))

    def last_upstream_request(self, scenario: str) -> dict:
        r = self.http.get(f"{self.mock_url}/mock/last", params={"scenario": scenario})
        assert r.status_code == 200, f"GET /mock/last?scenario={scenario} -> {r.status_code}: {r.text}"
        data = r.json()
        # Normalise header names to lower case (the contract says they are already).
        data["headers"] = {k.lower(): v for k, v in (data.get("headers") or {}).items()}
        if isinstance(data.get("body"), str):
            try:
                data["body"] = json.loads(data["body"])
            except ValueError:
                pass
        return data

    # --- raw HTTP to the gateway ------------------------------------------------------
    def session_used(self, session: str, until, *, key: str = TENANT_A_KEY, timeout_s: float = 5.0) -> dict:
        """`used` of `GET /v1/sessions/{session}` once `until(used)` holds, polled: a
        stream's usage settles just after its last byte reaches the client. Returns the
        last `used` seen either way, for the caller's assertion to show."""
        deadline, used = time.monotonic() + timeout_s, None
        while True:
            r = self.get(f"/v1/sessions/{session}", headers={"authorization": f"Bearer {key}"})
            if r.status_code == 200:
                used = r.json()["used"]
                if until(used):
                    return used
            if time.monotonic() >= deadline:
                assert r.status_code == 200, r.text
                return used
            time.sleep(0.02)

    def post(self, path: str, *, json_body: Any = None, content: bytes | None = None,
             headers: dict | None = None, timeout: float = 30.0):
        hdrs = {"content-type": "application/json"}
        hdrs.update(headers or {})
        if content is None:
            content = json.dumps(json_body).encode()
        return self.http.post(f"{self.url}{path}", content=content, headers=hdrs, timeout=timeout)

    def get(self, path: str, *, headers: dict | None = None):
        return self.http.get(f"{self.url}{path}", headers=headers or {})

    def tail_logs(self, lines: int = 60) -> str:
        out = []
        for label, path in (("backstop serve", self.server_log), ("backstop mock-upstream", self.mock_log)):
            try:
                text = path.read_text(errors="replace").splitlines()
            except OSError as exc:
                text = [f"<cannot read {path}: {exc}>"]
            out.append(f"----- {label} ({path}), last {lines} lines -----")
            out.extend(text[-lines:])
        return "\n".join(out)


# --- assertion helpers --------------------------------------------------------------------

def _json(resp) -> Any:
    try:
        return resp.json()
    except ValueError as exc:  # pragma: no cover - diagnostic path
        raise AssertionError(f"response body is not JSON ({resp.status_code}): {resp.text!r}") from exc


def assert_openai_error(resp, *, status: int, type_: str, code: str | None = None,
                        param: str | None = None) -> dict:
    """Assert an OpenAI-shaped error: {"error": {"message", "type", "code", "param"}}."""
    body = _json(resp)
    assert resp.status_code == status, f"expected HTTP {status}, got {resp.status_code}: {body}"
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), f"not OpenAI-shaped: {body}"
    err = body["error"]
    assert isinstance(err.get("message"), str) and err["message"], f"error.message missing/empty: {body}"
    assert err.get("type") == type_, f"error.type: expected {type_!r}, body {body}"
    if code is not None:
        assert err.get("code") == code, f"error.code: expected {code!r}, body {body}"
    if param is not None:
        assert err.get("param") == param, f"error.param: expected {param!r}, body {body}"
    assert "type" not in body or body.get("type") != "error", f"OpenAI route answered in Anthropic shape: {body}"
    return body


def assert_anthropic_error(resp, *, status: int, type_: str) -> dict:
    """Assert an Anthropic-shaped error: {"type": "error", "error": {"type", "message"}}."""
    body = _json(resp)
    assert resp.status_code == status, f"expected HTTP {status}, got {resp.status_code}: {body}"
    assert isinstance(body, dict) and body.get("type") == "error", f"not Anthropic-shaped: {body}"
    err = body.get("error")
    assert isinstance(err, dict), f"not Anthropic-shaped: {body}"
    assert err.get("type") == type_, f"error.type: expected {type_!r}, body {body}"
    assert isinstance(err.get("message"), str) and err["message"], f"error.message missing/empty: {body}"
    return body


def assert_no_tenant_key(upstream_request: dict) -> None:
    """The upstream must never see a tenant (Backstop) key in any header."""
    for name, value in upstream_request["headers"].items():
        for key in (TENANT_A_KEY, TENANT_B_KEY):
            assert key not in str(value), f"tenant key leaked upstream in header {name!r}: {value!r}"
