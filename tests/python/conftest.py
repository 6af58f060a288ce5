"""pytest fixtures: start `backstop mock-upstream` and `backstop serve` once per session.

The mock is strict (`--strict`): it refuses what the real APIs refuse (unknown fields, a
missing `max_tokens`, a tool result that answers no call), so a request the SDKs or
Backstop build wrongly fails here as it would against the provider. A test that means
to send what a provider would refuse says `x-mock-strict: off`.

The binary is taken from $BACKSTOP_BIN, else <repo>/target/debug/backstop. These tests
never build it: run `cargo build` first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import anthropic
import openai
import pytest

from backstop_support import (
    BEDROCK_SESSION,
    TENANT_A_KEY,
    TENANT_B_KEY,
    Backstop,
    free_port,
    httpx,
    render_config,
    scenario_name,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 20.0

# llamaindex/ needs openai<3 (llama-index-llms-openai's pin) where the rest needs
# openai>=3 (openai-agents'): a run of this directory leaves it out, and .ci/run runs it
# by name in a virtualenv of its own (`pytest tests/python/llamaindex`).
collect_ignore = ["llamaindex"]
SDK_TIMEOUT_S = 20.0

_RUNNING: Backstop | None = None  # for the failure-report hook below


def _find_binary() -> Path:
    env = os.environ.get("BACKSTOP_BIN")
    candidate = Path(env) if env else REPO_ROOT / "target" / "debug" / "backstop"
    if not candidate.is_file() or not os.access(candidate, os.X_OK):
        how = f"$BACKSTOP_BIN={env!r}" if env else f"default path {candidate}"
        pytest.fail(
            f"backstop binary not found or not executable ({how}). "
            f"Run `cargo build` in {REPO_ROOT} first (or point BACKSTOP_BIN at the binary).",
            pytrace=False,
        )
    return candidate


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def _wait_until_up(name: str, url: str, proc: subprocess.Popen, bs: Backstop) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    last = "no attempt yet"
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(
                    f"{name} exited early with code {proc.returncode} while waiting for {url}\n"
                    f"{bs.tail_logs(120)}",
                    pytrace=False,
                )
            try:
                r = client.get(url)
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.1)
    pytest.fail(
        f"{name} did not answer 200 on {url} within {STARTUP_TIMEOUT_S:.0f}s (last: {last})\n"
        f"{bs.tail_logs(120)}",
        pytrace=False,
    )


@pytest.fixture(scope="session")
def backstop(tmp_path_factory) -> Backstop:
    global _RUNNING
    binary = _find_binary()
    workdir = tmp_path_factory.mktemp("backstop")

    port, mock_port, dead_port = free_port(), free_port(), free_port()
    while len({port, mock_port, dead_port}) < 3:
        mock_port, dead_port = free_port(), free_port()

    config_path = workdir / "backstop.toml"
    config_path.write_text(render_config(port=port, mock_port=mock_port, dead_port=dead_port))

    bs = Backstop(
        binary=binary,
        port=port,
        mock_port=mock_port,
        dead_port=dead_port,
        config_path=config_path,
        server_log=workdir / "serve.log",
        mock_log=workdir / "mock.log",
    )

    mock_proc = server_proc = None
    mock_out = open(bs.mock_log, "wb")
    server_out = open(bs.server_log, "wb")
    try:
        mock_proc = subprocess.Popen(
            [str(binary), "mock-upstream", "--listen", f"127.0.0.1:{mock_port}", "--strict"],
            stdout=mock_out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=workdir,
        )
        _wait_until_up("backstop mock-upstream", f"{bs.mock_url}/mock/stats", mock_proc, bs)

        # The standard AWS chain of `bedrock-chain` reads its credentials here; no
        # profile or instance metadata of the machine may stand in for them.
        server_env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        server_env.update(BEDROCK_SESSION)
        server_env["AWS_CONFIG_FILE"] = server_env["AWS_SHARED_CREDENTIALS_FILE"] = "/dev/null"
        server_env["AWS_EC2_METADATA_DISABLED"] = "true"
        server_proc = subprocess.Popen(
            [str(binary), "serve", "--config", str(config_path)],
            stdout=server_out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=workdir,
            env=server_env,
        )
        _wait_until_up("backstop serve", f"{bs.url}/readyz", server_proc, bs)

        _RUNNING = bs
        yield bs
    finally:
        _RUNNING = None
        _stop(server_proc)
        _stop(mock_proc)
        if bs._http is not None:
            bs._http.close()
        mock_out.close()
        server_out.close()


@pytest.fixture
def scenario(request) -> str:
    """A mock scenario name unique to this test (attempts are counted per scenario)."""
    return scenario_name(request.node.nodeid)


@pytest.fixture
def oai(backstop) -> openai.OpenAI:
    client = openai.OpenAI(
        api_key=TENANT_A_KEY, base_url=backstop.openai_base_url, max_retries=0, timeout=SDK_TIMEOUT_S
    )
    yield client
    client.close()


@pytest.fixture
def oai_b(backstop) -> openai.OpenAI:
    client = openai.OpenAI(
        api_key=TENANT_B_KEY, base_url=backstop.openai_base_url, max_retries=0, timeout=SDK_TIMEOUT_S
    )
    yield client
    client.close()


@pytest.fixture
def anth(backstop) -> anthropic.Anthropic:
    client = anthropic.Anthropic(
        api_key=TENANT_A_KEY, base_url=backstop.anthropic_base_url, max_retries=0, timeout=SDK_TIMEOUT_S
    )
    yield client
    client.close()


@pytest.fixture
def anth_b(backstop) -> anthropic.Anthropic:
    client = anthropic.Anthropic(
        api_key=TENANT_B_KEY, base_url=backstop.anthropic_base_url, max_retries=0, timeout=SDK_TIMEOUT_S
    )
    yield client
    client.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and report.when in ("setup", "call") and _RUNNING is not None:
        report.sections.append(("backstop logs", _RUNNING.tail_logs(60)))
