"""One loopback check for every server ragline starts or reaches (issue 23 item 6)."""
import pytest

from ragline.flows.ops.llm_server import is_local
from ragline.flows.net import is_loopback


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost", "LOCALHOST",
                                  "::ffff:127.0.0.1"])
def test_loopback_hosts(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "192.168.1.5", "10.0.0.1", "::2", "example.com",
                                  "localhost.example.com", ""])
def test_wildcard_and_remote_hosts_are_not_loopback(host):
    """0.0.0.0 and :: bind every interface: a server there is reachable from the network."""
    assert not is_loopback(host)


@pytest.mark.parametrize("url, local", [("http://127.0.0.1:8000/v1", True), ("http://localhost:8000/v1", True),
                                        ("http://[::1]:8000/v1", True), ("http://0.0.0.0:8000/v1", False),
                                        ("http://[::]:8000/v1", False), ("http://10.0.0.1:8000/v1", False)])
def test_the_llm_endpoint_is_local_only_on_loopback(url, local):
    """Regression: llm_server counted 0.0.0.0 as loopback (its own list, beside two other checks)."""
    assert is_local(url) is local
