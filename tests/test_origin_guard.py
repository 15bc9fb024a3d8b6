"""The server trusts only its user: a real uvicorn server on 127.0.0.1 (test_server's tiny
models) refuses a request whose `Host` is not its address (DNS rebinding) or whose `Origin`
is another site's, and serves the names and web origins the user allowed."""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from test_server import HELLO, TinyProvider, serving

from mlxspec.server.origin_guard import OriginGuard, is_loopback, split_host

WEB_UI = "http://localhost:3000"
CHAT_BODY = {"model": "tiny", "messages": HELLO, "max_tokens": 2, "temperature": 0}
MESSAGE_BODY = {"model": "tiny", "messages": HELLO, "max_tokens": 2}


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with serving(TinyProvider(), allowed_hosts=["mybox.lan"], cors_origins=[WEB_UI]) as url:
        yield url


def port_of(url: str) -> int:
    return urlsplit(url).port


def test_a_rebinding_page_is_refused_in_each_dialects_shape(base_url):
    """attacker.example resolved to 127.0.0.1: the browser sends its own name as Host."""
    rebound = {"Host": f"attacker.example:{port_of(base_url)}"}
    chat = httpx.post(f"{base_url}/v1/chat/completions", json=CHAT_BODY, headers=rebound)
    assert chat.status_code == 403
    assert chat.json()["error"]["code"] == "forbidden_origin"
    assert "attacker.example" in chat.json()["error"]["message"]
    message = httpx.post(f"{base_url}/v1/messages", json=MESSAGE_BODY, headers=rebound)
    assert message.status_code == 403
    assert message.json()["type"] == "error" and message.json()["error"]["type"]
    assert httpx.get(f"{base_url}/health", headers=rebound).status_code == 403


def test_the_loopback_names_on_the_servers_port_are_served(base_url):
    port = port_of(base_url)
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", f"LOCALHOST:{port}"):
        response = httpx.get(f"{base_url}/v1/models", headers={"Host": host})
        assert response.status_code == 200, host
    # another port is another server: a rebinding page on :80 says "localhost" too
    wrong_port = httpx.get(f"{base_url}/v1/models", headers={"Host": f"localhost:{port + 1}"})
    assert wrong_port.status_code == 403


def test_an_allowed_host_is_served(base_url):
    response = httpx.post(
        f"{base_url}/v1/chat/completions",
        json=CHAT_BODY,
        headers={"Host": f"mybox.lan:{port_of(base_url)}"},
    )
    assert response.status_code == 200 and response.json()["choices"]


def test_a_cross_origin_post_is_refused(base_url):
    evil = {"Origin": "https://evil.example"}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=CHAT_BODY, headers=evil)
    assert response.status_code == 403
    assert "evil.example" in response.json()["error"]["message"]
    preflight = httpx.options(
        f"{base_url}/v1/chat/completions",
        headers={**evil, "Access-Control-Request-Method": "POST"},
    )
    assert preflight.status_code == 403
    assert "access-control-allow-origin" not in preflight.headers


def test_the_servers_own_origin_is_served(base_url):
    response = httpx.get(f"{base_url}/v1/models", headers={"Origin": base_url})
    assert response.status_code == 200


def test_an_allowed_web_ui_gets_its_preflight_and_its_answer(base_url):
    preflight = httpx.options(
        f"{base_url}/v1/chat/completions",
        headers={
            "Origin": WEB_UI,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == WEB_UI
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    response = httpx.post(
        f"{base_url}/v1/chat/completions", json=CHAT_BODY, headers={"Origin": WEB_UI}
    )
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == WEB_UI


def test_a_star_opens_hosts_and_origins():
    with serving(TinyProvider(), allowed_hosts=["*"], cors_origins=["*"]) as url:
        headers = {"Host": "anything.example", "Origin": "https://ui.example"}
        assert httpx.get(f"{url}/v1/models", headers=headers).status_code == 200


@pytest.mark.parametrize(
    "header, expected",
    [
        ("Example.org:8000", ("example.org", 8000)),
        ("example.org", ("example.org", None)),
        ("[::1]:8000", ("::1", 8000)),
        ("[::1]", ("::1", None)),
        ("127.0.0.1:x", ("127.0.0.1", -1)),
    ],
)
def test_a_host_header_is_split_into_name_and_port(header, expected):
    assert split_host(header) == expected


def test_loopback_is_known_by_name_and_by_address():
    assert all(map(is_loopback, ["localhost", "127.0.0.1", "127.0.0.2", "::1", "[::1]"]))
    assert not any(map(is_loopback, ["0.0.0.0", "192.168.1.5", "attacker.example", "::"]))


@pytest.mark.parametrize(
    "host, server, served",
    [
        ("192.168.1.5:8000", ("192.168.1.5", 8000), True),  # a LAN client, by address
        ("localhost:8000", ("192.168.1.5", 8000), False),  # loopback names: loopback only
        ("127.0.0.1:8000", ("::ffff:127.0.0.1", 8000), True),  # IPv4 on a `::` socket
        ("[::1]:8000", ("::1", 8000), True),
        ("testserver", ("testserver", 80), True),  # no port: http's own
        ("attacker.example:8000", ("127.0.0.1", 8000), False),
        ("attacker.example", ("127.0.0.1", 80), False),
        ("localhost", None, True),  # a Unix socket
        ("attacker.example", None, False),
    ],
)
def test_a_host_is_served_where_it_names_the_connections_own_address(host, server, served):
    assert OriginGuard(app=None).host_allowed(host, server) is served
