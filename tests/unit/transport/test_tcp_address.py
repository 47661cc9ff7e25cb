"""Which addresses a rank offers and in which order a peer tries them (tcp_address.py), on
interface tables as real hosts have them; no MPI, no network."""
import pytest

from horolite.transport.tcp_address import (Address, Interface, interfaces, offered,
                                            order_for, parse_spec)


def iface(name, addr, prefix=24, up=True, loopback=False):
    return Interface(name, addr, prefix, up, loopback)


LO = iface("lo", "127.0.0.1", 8, loopback=True)
DOCKER_IDLE = iface("docker0", "172.17.0.1", 16, up=False)  # a bridge with no port: no carrier
DOCKER_BUSY = iface("docker0", "172.17.0.1", 16)


def test_loopback_bridges_and_interfaces_without_carrier_are_not_offered():
    table = [LO, iface("eth0", "10.1.3.7"), DOCKER_BUSY, iface("br-5e2a", "172.18.0.1", 16),
             iface("virbr0", "192.168.122.1"), iface("cni0", "10.244.0.1"),
             iface("eth1", "10.9.0.7", up=False)]
    assert offered("", table) == [Address("eth0", "10.1.3.7", 24)]


@pytest.mark.parametrize("only", ["eth0", "vethA"])
def test_a_pods_or_a_simulated_hosts_only_interface_is_offered(only):
    assert [a.iface for a in offered("", [LO, iface(only, "198.18.0.11")])] == [only]


def test_a_host_whose_only_network_is_a_bridge_still_offers_it():
    assert [a.iface for a in offered("", [LO, iface("br-lan", "10.0.0.5")])] == ["br-lan"]


def test_the_setting_names_interfaces_as_ncclsocket_ifname_does():
    table = [LO, iface("eno1", "192.168.0.7"), iface("ens1f0", "10.10.0.7"), DOCKER_BUSY]
    assert [a.iface for a in offered("ens", table)] == ["ens1f0"]
    assert [a.iface for a in offered("=eno1", table)] == ["eno1"]
    assert [a.iface for a in offered("^eno", table)] == ["ens1f0", "docker0"]
    assert [a.iface for a in offered("docker0", table)] == ["docker0"]  # named: allowed
    assert [a.iface for a in offered("eno1,ens1f0", table)] == ["eno1", "ens1f0"]
    assert parse_spec("^=lo,docker0") == ("exclude", ["lo", "docker0"], True)
    with pytest.raises(OSError, match=r"no interface matches HOROLITE_TCP_IFACE='ib0'.*"
                                      r"eno1, ens1f0"):
        offered("ib0", table)


def test_routed_subnets_with_docker0_dial_the_peers_real_address():
    """The review's scenario A: the eth0s share no subnet, every docker0 does. The peer's
    docker0 is never offered, so it is never dialled."""
    here = offered("", [LO, iface("eth0", "10.1.3.7"), DOCKER_IDLE])
    there = offered("", [LO, iface("eth0", "10.1.2.5"), DOCKER_BUSY])
    assert order_for(here, there) == ["10.1.2.5"]


def test_the_peers_host_name_address_comes_first_then_a_shared_subnet():
    mine = [Address("eno1", "192.168.0.7", 24), Address("ens1f0", "10.10.0.7", 24)]
    theirs = [Address("eno1", "192.168.0.8", 24), Address("ens1f0", "10.10.0.8", 24),
              Address("wg0", "10.99.0.8", 24)]
    # Its host name resolves to the data network: that first, though listed second.
    assert order_for(mine, theirs, ["10.10.0.8"]) == ["10.10.0.8", "192.168.0.8", "10.99.0.8"]
    # No name: the shared subnets in its order, then the rest.
    assert order_for(mine, theirs) == ["192.168.0.8", "10.10.0.8", "10.99.0.8"]
    # A secondary address on a shared subnet comes before a primary one on another.
    assert order_for([Address("eth0", "198.18.0.11", 24)],
                     [Address("eth0", "198.19.0.12", 24), Address("eth0", "198.18.0.12", 24)]
                     ) == ["198.18.0.12", "198.19.0.12"]


def test_this_hosts_table_is_read_with_flags():
    found = interfaces()
    assert any(i.loopback and i.addr.startswith("127.") for i in found)
    assert all(0 <= i.prefix <= 32 for i in found)


def test_a_peer_host_without_an_ipv4_address_is_a_clear_error_not_this_host():
    """IPv4 only (docs/multihost.md): a peer on another machine that offers no address is
    named as such at set-up, never dialled at 127.0.0.1 (which would be this host)."""
    import time
    from horolite.transport import tcp
    mine = {"addrs": [Address("eth0", "10.1.3.7", 24)]}
    theirs = {"machine": "node2", "addrs": [], "named": [], "port": 40000}
    with pytest.raises(tcp.SetupError, match=r"rank 0 could not connect to rank 1 \(host node2\)"
                       r": it offers no address \(HOROLITE_TCP_IFACE\)"):
        tcp._connect(0, 1, theirs, mine, "node1", True, 2, b"k" * 32, time.monotonic() + 1, 1.0,
                     lambda q: "rank 0" if q == 0 else "rank 1 (host node2)")
