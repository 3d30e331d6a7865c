"""Access: the worker token, the admin token, and TLS on every listener.

Certificates come from a CA made at test time (``trustme``), for 127.0.0.1. Workers and frontends
run in-process on loopback with port 0; every test runs under ``trio.fail_after``.
"""

from __future__ import annotations

import dataclasses
import logging
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trustme

from frontend_shim._app import run_frontend
from frontend_shim._cli import parse_args as parse_frontend_args
from frontend_shim._config import FrontendSettings
from frontend_shim._connection import open_plane
from frontend_shim._links import LinkSettings, WorkerLink
from frontend_shim._websocket import HandshakeError, HandshakeRejected
from shim_common import wire
from shim_common._access import TLSFiles, bearer_matches, client_context, token_from_env
from shim_common._cli import CliError
from worker_ingress._cli import parse_args as parse_worker_args
from worker_ingress._config import WorkerSettings
from worker_ingress._server import Worker, WorkerAddress
from worker_ingress.engines._instant import create

TIMEOUT = 20.0
MODEL = "mock-model"
TOKEN = "s3cret-token-for-tests"


@dataclasses.dataclass(frozen=True)
class Certs:
    ca: trustme.CA
    ca_path: str
    cert_path: str
    key_path: str

    def trusting_context(self) -> ssl.SSLContext:
        return client_context(self.ca_path)


def write_certs(directory: Path, ca: trustme.CA | None = None) -> Certs:
    ca = ca or trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    directory.mkdir(parents=True, exist_ok=True)
    ca_path, cert_path, key_path = (directory / name for name in ("ca.pem", "cert.pem", "key.pem"))
    ca.cert_pem.write_to_path(str(ca_path))
    cert_path.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    leaf.private_key_pem.write_to_path(str(key_path))
    return Certs(ca, str(ca_path), str(cert_path), str(key_path))


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return write_certs(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def other_certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    """Certificates of a CA nobody here trusts."""
    return write_certs(tmp_path_factory.mktemp("other-tls"))


# ----------------------------------------------------------------------------- helpers


def worker_settings(**changes: Any) -> WorkerSettings:
    base = WorkerSettings(
        worker_id="w-access",
        host="127.0.0.1",
        port=0,
        system_port=0,
        heartbeat_interval=0.05,
        drain_grace=1.0,
    )
    return dataclasses.replace(base, **changes)


@asynccontextmanager
async def running_worker(settings: WorkerSettings) -> AsyncIterator[tuple[Worker, WorkerAddress]]:
    worker = Worker(settings, create(settings))
    async with trio.open_nursery() as nursery:
        address: WorkerAddress = await nursery.start(worker.serve)
        yield worker, address
        nursery.cancel_scope.cancel()


def host_port(url: str) -> tuple[str, int]:
    parsed = httpx.URL(url)
    assert parsed.port is not None
    return parsed.host, parsed.port


async def open_request_plane(
    url: str, *, token: str | None = None, ssl_context: ssl.SSLContext | None = None
) -> wire.Hello:
    """Open the request plane, read the hello, close; raises what the handshake raised."""
    host, port = host_port(url)
    headers = [("Authorization", f"Bearer {token}")] if token is not None else []
    connection = await open_plane(
        host=host,
        port=port,
        path=wire.REQUESTS_PATH,
        headers=headers,
        ssl_context=ssl_context,
        max_message_bytes=wire.MAX_MESSAGE_BYTES,
    )
    try:
        hello = wire.decode_worker_message((await connection.messages())[0])
    finally:
        await connection.aclose(1.0)
    assert isinstance(hello, wire.Hello)
    return hello


async def scrape(url: str, *, verify: ssl.SSLContext | bool = True) -> str:
    async with httpx.AsyncClient(verify=verify) as client:
        reply = await client.get(url + "/metrics")
    assert reply.status_code == 200
    return reply.text


def sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in the metrics")


# ----------------------------------------------------------------------------- tokens, units


def test_a_token_must_be_visible_ascii_and_is_never_echoed() -> None:
    assert token_from_env("T", {}) is None
    assert token_from_env("T", {"T": "abc-123_~+/="}) == "abc-123_~+/="
    for bad in ("", "with space", "tab\there", "caf\u00e9"):
        with pytest.raises(CliError, match="T ") as caught:
            token_from_env("T", {"T": bad})
        if bad:
            assert bad not in str(caught.value)


def test_bearer_matching() -> None:
    token = b"abc"
    assert bearer_matches(b"Bearer abc", token)
    assert bearer_matches(b"bearer abc", token)
    assert bearer_matches(b"BEARER  abc ", token)
    assert not bearer_matches(None, token)
    assert not bearer_matches(b"Bearer abd", token)
    assert not bearer_matches(b"Bearer ab", token)
    assert not bearer_matches(b"Basic abc", token)
    assert not bearer_matches(b"abc", token)


def test_tokens_stay_out_of_settings_repr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_WORKER_TOKEN", TOKEN)
    monkeypatch.setenv("DYN_ADMIN_TOKEN", TOKEN + "-admin")
    worker, _ = parse_worker_args([])
    frontend, _ = parse_frontend_args([])
    assert worker.token == TOKEN
    assert (frontend.worker_token, frontend.admin_token) == (TOKEN, TOKEN + "-admin")
    assert TOKEN not in repr(worker)
    assert TOKEN not in repr(frontend)


def test_tls_files_are_checked_together(certs: Certs, tmp_path: Path) -> None:
    with pytest.raises(CliError, match=r"--tls-cert-path.*needs --tls-key-path"):
        TLSFiles(certs.cert_path, None)
    with pytest.raises(CliError, match=r"--tls-key-path.*needs --tls-cert-path"):
        TLSFiles(None, certs.key_path)
    missing = str(tmp_path / "nowhere.pem")
    with pytest.raises(CliError, match=r'"[^"]*nowhere.pem" for --tls-cert-path'):
        TLSFiles(missing, certs.key_path)
    with pytest.raises(CliError, match="do not load"):
        TLSFiles(certs.ca_path, certs.key_path)  # a certificate that is not the key's
    assert TLSFiles(certs.cert_path, certs.key_path).enabled
    assert not TLSFiles(None, None).enabled


@pytest.mark.parametrize(
    ("program", "args", "env", "named"),
    [
        ("worker_ingress", ["--tls-cert-path", "CERT"], {}, "--tls-key-path"),
        ("frontend_shim", ["--tls-key-path", "KEY"], {}, "--tls-cert-path"),
        ("frontend_shim", ["--tls-ca-path", "MISSING"], {}, "--tls-ca-path"),
        ("worker_ingress", [], {"DYN_TLS_CERT_PATH": "MISSING", "DYN_TLS_KEY_PATH": "KEY"}, "CERT"),
        ("worker_ingress", [], {"DYN_WORKER_TOKEN": ""}, "DYN_WORKER_TOKEN"),
        ("frontend_shim", [], {"DYN_ADMIN_TOKEN": "zq zq"}, "DYN_ADMIN_TOKEN"),
    ],
)
def test_bad_access_settings_exit_2_naming_the_flag(
    certs: Certs, program: str, args: list[str], env: dict[str, str], named: str
) -> None:
    def fill(value: str) -> str:
        return {"CERT": certs.cert_path, "KEY": certs.key_path, "MISSING": "/no/such.pem"}.get(
            value, value
        )

    environment = {"PATH": "/usr/bin:/bin", **{key: fill(value) for key, value in env.items()}}
    result = subprocess.run(
        [sys.executable, "-m", program, *(fill(arg) for arg in args)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, result.stderr
    expected = "--tls-cert-path" if named == "CERT" else named
    assert expected in lines[0]
    assert "zq zq" not in lines[0]


# ----------------------------------------------------------------------------- the worker token


async def test_the_worker_admits_the_right_token_and_refuses_others_with_401(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    with trio.fail_after(TIMEOUT):
        async with running_worker(worker_settings(token=TOKEN)) as (_, address):
            hello = await open_request_plane(address.ws_url, token=TOKEN)
            assert hello.config.worker_id == "w-access"
            for presented in (None, "wrong", TOKEN + "x"):
                with pytest.raises(HandshakeRejected) as refused:
                    await open_request_plane(address.ws_url, token=presented)
                assert refused.value.status == 401
            # The event plane is guarded the same way.
            host, port = host_port(address.ws_url)
            with pytest.raises(HandshakeRejected, match="401"):
                await open_plane(
                    host=host,
                    port=port,
                    path=wire.EVENTS_PATH,
                    max_message_bytes=wire.MAX_MESSAGE_BYTES,
                )
            metrics = await scrape(address.system_url)
    assert sample(metrics, "dynamo_worker_unauthorized_total") == 4
    assert "refused" in caplog.text
    assert TOKEN not in caplog.text
    assert TOKEN not in metrics


async def test_a_401_carries_www_authenticate_and_no_upgrade() -> None:
    with trio.fail_after(TIMEOUT):
        async with running_worker(worker_settings(token=TOKEN)) as (_, address):
            host, port = host_port(address.ws_url)
            stream = await trio.open_tcp_stream(host, port)
            async with stream:
                await stream.send_all(
                    b"GET /v1/requests HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                    b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                    b"Sec-WebSocket-Version: 13\r\n\r\n"
                )
                answer = b""
                for _ in range(100):
                    data = await stream.receive_some()
                    answer += data
                    if not data or b"\r\n\r\n" in answer:
                        break
    head = answer.split(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 401 ")
    assert b"www-authenticate: bearer" in head
    assert b"upgrade:" not in head


async def test_a_token_sent_to_a_worker_without_one_is_ignored() -> None:
    with trio.fail_after(TIMEOUT):
        async with running_worker(worker_settings()) as (_, address):
            hello = await open_request_plane(address.ws_url, token="anything")
    assert hello.config.worker_id == "w-access"


# ----------------------------------------------------------------------------- worker TLS


async def test_a_wss_worker_serves_clients_that_trust_its_ca_only(
    certs: Certs, other_certs: Certs
) -> None:
    settings = worker_settings(tls_cert_path=certs.cert_path, tls_key_path=certs.key_path)
    with trio.fail_after(TIMEOUT):
        async with running_worker(settings) as (_, address):
            assert address.ws_url.startswith("wss://127.0.0.1:")
            assert address.system_url.startswith("https://127.0.0.1:")
            hello = await open_request_plane(address.ws_url, ssl_context=certs.trusting_context())
            assert hello.config.worker_id == "w-access"
            with pytest.raises(trio.BrokenResourceError) as untrusted:
                await open_request_plane(address.ws_url, ssl_context=other_certs.trusting_context())
            assert isinstance(untrusted.value.__cause__, ssl.SSLCertVerificationError)
            metrics = await scrape(address.system_url, verify=certs.trusting_context())
            # The untrusting client gave up in the middle of the handshake: counted.
            assert sample(metrics, "dynamo_worker_tls_handshake_failures_total") >= 1


async def test_plain_ws_to_a_wss_worker_fails_at_once_and_is_counted(certs: Certs) -> None:
    settings = worker_settings(tls_cert_path=certs.cert_path, tls_key_path=certs.key_path)
    with trio.fail_after(TIMEOUT):
        async with running_worker(settings) as (_, address):
            plain = address.ws_url.replace("wss://", "ws://")
            # Well within the link's 5 s connect timeout: the worker closes at once.
            with trio.fail_after(3), pytest.raises((HandshakeError, trio.BrokenResourceError)):
                await open_request_plane(plain)
            metrics = await scrape(address.system_url, verify=certs.trusting_context())
    assert sample(metrics, "dynamo_worker_tls_handshake_failures_total") == 1


class _Listener:
    def worker_up(self, key: str, config: wire.RuntimeConfig, now: float) -> None:
        pass

    def worker_events(self, key: str, events: Sequence[wire.WorkerEvent], now: float) -> None:
        pass

    def worker_lagging(self, key: str, lagging: bool, now: float) -> None:
        pass

    def worker_down(self, key: str, now: float) -> None:
        pass

    def thresholds(self, model: str) -> wire.BusyThresholds | None:
        return None


FAST_LINK = LinkSettings(connect_timeout=2.0, backoff_initial=0.02, backoff_cap=0.1)


async def link_log(url: str, settings: LinkSettings, caplog: pytest.LogCaptureFixture) -> str:
    """Run a link to ``url`` until it has failed twice; the warnings it logged."""
    link = WorkerLink(url, _Listener(), settings)
    async with trio.open_nursery() as nursery:
        await nursery.start(link.run)
        for _ in range(500):
            if link.stats.connect_failures >= 2:
                break
            await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert not link.connected
    assert link.stats.connect_failures >= 2, "the link retries"
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


async def test_a_link_says_tls_when_a_scheme_does_not_match(
    certs: Certs, caplog: pytest.LogCaptureFixture
) -> None:
    tls_settings = worker_settings(tls_cert_path=certs.cert_path, tls_key_path=certs.key_path)
    with trio.fail_after(TIMEOUT):
        async with running_worker(tls_settings) as (_, address):
            text = await link_log(address.ws_url.replace("wss://", "ws://"), FAST_LINK, caplog)
        assert "TLS?" in text
        caplog.clear()
        async with running_worker(worker_settings()) as (_, address):
            trusting = dataclasses.replace(FAST_LINK, ssl_context=certs.trusting_context())
            text = await link_log(address.ws_url.replace("ws://", "wss://"), trusting, caplog)
        assert "TLS" in text


async def test_a_link_with_an_untrusted_worker_says_why(
    certs: Certs, other_certs: Certs, caplog: pytest.LogCaptureFixture
) -> None:
    settings = worker_settings(tls_cert_path=certs.cert_path, tls_key_path=certs.key_path)
    with trio.fail_after(TIMEOUT):
        async with running_worker(settings) as (_, address):
            untrusting = dataclasses.replace(FAST_LINK, ssl_context=other_certs.trusting_context())
            text = await link_log(address.ws_url, untrusting, caplog)
    assert "certificate verify failed" in text


async def test_a_refused_token_is_logged_plainly_and_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with trio.fail_after(TIMEOUT):
        async with running_worker(worker_settings(token=TOKEN)) as (worker, address):
            wrong = dataclasses.replace(FAST_LINK, headers=(("Authorization", "Bearer nope"),))
            text = await link_log(address.ws_url, wrong, caplog)
            refused = worker.metrics.registry.get_sample_value("dynamo_worker_unauthorized_total")
            assert refused is not None
            assert refused >= 2
    assert "worker refused the token" in text
    assert "nope" not in text


# ----------------------------------------------------------------------------- the frontend


def chat(max_tokens: int = 3) -> dict[str, Any]:
    messages = [{"role": "user", "content": "hi"}]
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens}


@asynccontextmanager
async def frontend(
    workers: Sequence[WorkerSettings], **options: Any
) -> AsyncIterator[tuple[str, list[Worker]]]:
    """In-process workers and a frontend on them; yields the frontend's URL and the workers."""
    async with trio.open_nursery() as nursery:
        started: list[Worker] = []
        urls: list[str] = []
        for settings in workers:
            worker = Worker(settings, create(settings))
            address: WorkerAddress = await nursery.start(worker.serve)
            started.append(worker)
            urls.append(address.ws_url)
        frontend_settings = FrontendSettings(http_port=0, workers=tuple(urls), **options)
        async with trio.open_nursery() as frontend_nursery:
            url: str = await frontend_nursery.start(run_frontend, frontend_settings)
            yield url, started
            frontend_nursery.cancel_scope.cancel()
        nursery.cancel_scope.cancel()


async def wait_connected(client: httpx.AsyncClient, url: str, count: int) -> None:
    for _ in range(500):
        health = (await client.get(url + "/health")).json()
        if health["workers_connected"] == count:
            return
        await trio.sleep(0.02)
    raise AssertionError(f"never {count} workers connected")


async def test_admin_token_guards_busy_threshold_only() -> None:
    with trio.fail_after(TIMEOUT):
        async with (
            frontend([worker_settings()], admin_token=TOKEN) as (url, _),
            httpx.AsyncClient() as client,
        ):
            await wait_connected(client, url, 1)
            update = {"model": MODEL, "active_decode_blocks_threshold": 0.5}
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                for reply in (
                    await client.get(url + "/busy_threshold", headers=headers),
                    await client.post(url + "/busy_threshold", json=update, headers=headers),
                ):
                    assert reply.status_code == 401
                    assert reply.headers["www-authenticate"] == "Bearer"
                    error = reply.json()["error"]
                    assert error["code"] == 401
                    assert "message" in error
                    assert "type" in error
            good = {"Authorization": f"Bearer {TOKEN}"}
            reply = await client.post(url + "/busy_threshold", json=update, headers=good)
            assert reply.status_code == 200
            assert reply.json()["active_decode_blocks_threshold"] == 0.5
            reply = await client.get(url + "/busy_threshold", headers=good)
            assert reply.json()["thresholds"][0]["active_decode_blocks_threshold"] == 0.5
            # Everything else stays open.
            for path in ("/metrics", "/health", "/live", "/v1/models"):
                assert (await client.get(url + path)).status_code == 200, path
            assert (await client.post(url + "/v1/chat/completions", json=chat())).status_code == 200


async def test_a_mixed_fleet_serves_on_the_workers_that_take_the_token() -> None:
    good = [worker_settings(worker_id=f"good-{i}", token=TOKEN) for i in range(2)]
    bad = worker_settings(worker_id="bad", token="another-token")
    with trio.fail_after(TIMEOUT):
        async with (
            frontend([*good, bad], worker_token=TOKEN) as (url, workers),
            httpx.AsyncClient() as client,
        ):
            await wait_connected(client, url, 2)
            replies = [
                await client.post(url + "/v1/chat/completions", json=chat()) for _ in range(6)
            ]
            assert [reply.status_code for reply in replies] == [200] * 6
            refused_by_bad = workers[2].metrics.registry.get_sample_value(
                "dynamo_worker_unauthorized_total"
            )
            assert refused_by_bad is not None
            assert refused_by_bad >= 1
            for worker in workers[:2]:
                assert worker.gate.state.started_total >= 1
                assert (
                    worker.metrics.registry.get_sample_value("dynamo_worker_unauthorized_total")
                    == 0
                )
            assert workers[2].gate.state.started_total == 0


async def test_https_frontend_with_wss_workers_and_the_openai_sdk(certs: Certs) -> None:
    openai = pytest.importorskip("openai")
    worker = worker_settings(
        token=TOKEN, tls_cert_path=certs.cert_path, tls_key_path=certs.key_path
    )
    with trio.fail_after(TIMEOUT):
        async with frontend(
            [worker],
            worker_token=TOKEN,
            tls_cert_path=certs.cert_path,
            tls_key_path=certs.key_path,
            tls_ca_path=certs.ca_path,
        ) as (url, _):
            assert url.startswith("https://127.0.0.1:")
            async with httpx.AsyncClient(verify=certs.trusting_context()) as client:
                await wait_connected(client, url, 1)

            def stream_chat() -> list[str]:
                http = httpx.Client(verify=certs.trusting_context())
                sdk = openai.OpenAI(
                    base_url=url + "/v1", api_key="unused", max_retries=0, http_client=http
                )
                with sdk:
                    stream = sdk.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": "say something"}],
                        max_tokens=4,
                        stream=True,
                    )
                    return [chunk.choices[0].delta.content or "" for chunk in stream]

            pieces = await trio.to_thread.run_sync(stream_chat)
            assert len("".join(pieces).split()) == 4

            # A client that does not speak TLS, or gives up on it, costs one counted failure.
            host, port = host_port(url)
            stream = await trio.open_tcp_stream(host, port)
            async with stream:
                await stream.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                with trio.fail_after(5):
                    while await stream.receive_some():
                        pass
            async with httpx.AsyncClient(verify=certs.trusting_context()) as client:
                metrics = (await client.get(url + "/metrics")).text
            assert sample(metrics, "dynamo_frontend_tls_handshake_failures_total") == 1


# ----------------------------------------------------------------------------- impostors


async def test_a_peer_announcing_a_workers_id_takes_none_of_its_traffic() -> None:
    # Anyone can read a worker's id from its hello. Before, a peer listed beside the worker that
    # announced the same id and came up first took every completion (719 of 719 in the attack),
    # the worker standing by; whichever came up second got nothing. Now each address is a
    # worker of its own: the second under "<id>@<address>", logged and counted.
    twins = [worker_settings(worker_id="w-twin") for _ in range(2)]
    with trio.fail_after(TIMEOUT):
        async with frontend(twins) as (url, workers), httpx.AsyncClient() as client:
            await wait_connected(client, url, 2)
            for _ in range(12):
                reply = await client.post(url + "/v1/chat/completions", json=chat())
                assert reply.status_code == 200
            assert [worker.gate.state.started_total for worker in workers] == [6, 6]
            metrics = await scrape(url)
            assert sample(metrics, "dynamo_frontend_worker_id_collisions_total") == 1
            assert 'worker_id="w-twin@ws://127.0.0.1:' in metrics


async def test_over_wss_an_impostor_without_the_certificate_gets_no_token(
    certs: Certs, other_certs: Certs
) -> None:
    # What wss:// adds: the frontend checks the worker's certificate before it sends anything,
    # the token included. A peer that cannot present a certificate for the name it is reached
    # by never gets the upgrade request that carries the token, whatever id it would announce.
    tls = {"token": TOKEN, "tls_cert_path": certs.cert_path, "tls_key_path": certs.key_path}
    worker = worker_settings(worker_id="w-twin", **tls)
    impostor = worker_settings(
        worker_id="w-twin",
        token=TOKEN,
        tls_cert_path=other_certs.cert_path,
        tls_key_path=other_certs.key_path,
    )
    with trio.fail_after(TIMEOUT):
        async with (
            frontend([worker, impostor], worker_token=TOKEN, tls_ca_path=certs.ca_path) as (
                url,
                workers,
            ),
            httpx.AsyncClient() as client,
        ):
            await wait_connected(client, url, 1)
            for _ in range(4):
                reply = await client.post(url + "/v1/chat/completions", json=chat())
                assert reply.status_code == 200
            samples = workers[1].metrics.registry.get_sample_value
            await wait_for_sample(samples, "dynamo_worker_tls_handshake_failures_total")
            # No upgrade ever reached it: neither with the token (it would have served) nor
            # without (it would have counted a 401).
            assert workers[0].gate.state.started_total == 4
            assert workers[1].gate.state.started_total == 0
            assert samples("dynamo_worker_unauthorized_total") == 0
            assert sample(await scrape(url), "dynamo_frontend_worker_id_collisions_total") == 0


async def wait_for_sample(samples: Any, name: str) -> None:
    for _ in range(500):
        if (samples(name) or 0) >= 1:
            return
        await trio.sleep(0.02)
    raise AssertionError(f"{name} never counted")
