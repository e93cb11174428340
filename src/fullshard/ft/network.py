"""Where fault tolerance listens: one address, the user's `bind`, for every socket torchft's
pieces open (Note [one address]), and the torchft release those pieces were checked on.

Note [one address]: nothing in torchft authenticates (the lighthouse even has an HTTP endpoint
that kills a replica), so every listener of a fault-tolerant run is on the address the user
names, 127.0.0.1 unless told otherwise:
- the lighthouse: torchft's LighthouseServer, given `bind`;
- each replica group's TCPStore: a socket bound here, handed to the store (master_listen_fd);
- the Manager's server: torchft's Python wrapper binds it to [::], so manager.py patches that
  one argument for the one call;
- the managed process group across replicas: gloo's device made for this address;
- the replica group's own gloo group: GLOO_SOCKET_IFNAME, the interface holding the address
  (gloo binds that interface's first address: on lo, 127.0.0.1).
A wildcard (0.0.0.0, ::) is taken only as typed, with a warning; a host name is refused, since
what it resolves to is not the user's to see.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import ipaddress
import socket
import struct
import warnings
from datetime import timedelta

from fullshard.errors import fail, require

TORCHFT_VERSION = "0.2.0"  # the release whose listeners Note [one address] accounts for
INSTALL = "pip install 'fullshard[ft]'"


def check_torchft() -> None:
    """Refuse a missing torchft, or another release than the one checked (a nightly opens
    another listener on every interface)."""
    try:
        version = importlib.metadata.version("torchft")
    except importlib.metadata.PackageNotFoundError:
        raise fail("fault tolerance needs torchft, which is not installed", f"Install it: {INSTALL}") from None
    require(version == TORCHFT_VERSION, f"fault tolerance was checked with torchft {TORCHFT_VERSION}, and torchft "
            f"{version} is installed (another release may listen on other addresses: Note [one address])",
            f"Install the checked release: {INSTALL}")


check_torchft()

import torch  # noqa: E402  (after the version check: an unchecked torchft is never imported)
from torch.distributed import ProcessGroup, ProcessGroupGloo as GlooBackend, TCPStore  # noqa: E402
from torchft._torchft import LighthouseServer  # noqa: E402
from torchft.process_group import ProcessGroupGloo as ReconfigurableGloo  # noqa: E402


def host_of(bind: object) -> str:
    """The IP address `bind` names, checked (Note [one address])."""
    require(isinstance(bind, str), f"bind={bind!r} must be an IP address as a string", "Pass e.g. bind='127.0.0.1'.")
    try:
        address = ipaddress.ip_address(bind)
    except ValueError:
        raise fail(f"bind={bind!r} is not an IP address (a host name may resolve to any interface)",
                   "Name the address of the interface to listen on, e.g. 127.0.0.1 on one host, or this "
                   "host's address on the cluster network") from None
    if address.is_unspecified:
        warnings.warn(f"fault tolerance listens on every interface ({bind}): nothing in torchft authenticates, "
                      f"and anyone who reaches these ports can stop or stall the run", stacklevel=3)
    return str(address)


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def interface_of(host: str) -> str:
    """The network interface that holds `host` (for GLOO_SOCKET_IFNAME)."""
    if ipaddress.ip_address(host).is_loopback:
        return "lo"
    require(":" not in host, f"bind={host!r}: the replica group's gloo group needs an IPv4 address",
            "Name the IPv4 address of an interface.")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == host:
                return name
    raise fail(f"bind={host!r} is the address of no interface of this host", "Name an address `ip addr` lists here.")


def replica_env(bind: str) -> dict[str, str]:
    """Environment for a rank before init_process_group: its gloo group on `bind`'s interface."""
    return {"GLOO_SOCKET_IFNAME": interface_of(host_of(bind))}


def replica_store(bind: str, port: int, *, is_master: bool, timeout: timedelta) -> TCPStore:
    """The replica group's TCPStore: the group's rank 0 (`is_master`) serves it on `bind`:`port`
    (0: any free port, read it from `store.port`), the others connect to it there."""
    host = host_of(bind)
    if not is_master:
        return TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
    except OSError as e:
        listener.close()
        raise fail(f"the replica group's store cannot listen on {host}:{port} ({e})",
                   "Pick a free port (or 0 for any) on an address of this host.") from None
    port = listener.getsockname()[1]
    return TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout,
                    master_listen_fd=listener.detach())  # the store owns the socket from here


class ProcessGroupGloo(ReconfigurableGloo):
    """torchft's reconfigurable gloo group across replicas, listening on `bind`'s address."""

    def __init__(self, bind: str = "127.0.0.1", timeout: timedelta = timedelta(seconds=60)) -> None:
        super().__init__(timeout=timeout)
        self.host = host_of(bind)

    def _create_pg(self, store, rank: int, world_size: int) -> ProcessGroup:
        options = GlooBackend._Options()
        options._timeout = self._timeout
        options._devices = [GlooBackend.create_device(hostname=self.host)]
        backend = GlooBackend(store, rank, world_size, options)
        backend._set_sequence_number_for_group()
        group = ProcessGroup(store, rank, world_size)
        group._set_default_backend(ProcessGroup.BackendType.GLOO)
        for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
            group._register_backend(torch.device(device), ProcessGroup.BackendType.GLOO, backend)
        return group


class Lighthouse:
    """torchft's lighthouse on `bind`:`port` (0: any free port): it forms the quorums.

    `min_replicas`: the fewest replica groups a step commits with. The timeouts are torchft's
    (milliseconds): how long a quorum waits for groups to join, how often it is formed, and how
    long a silent group stays a member."""

    def __init__(self, bind: str = "127.0.0.1", port: int = 0, *, min_replicas: int = 1, join_timeout_ms: int = 100,
                 quorum_tick_ms: int = 20, heartbeat_timeout_ms: int = 2000) -> None:
        self.host = host_of(bind)
        require(isinstance(min_replicas, int) and min_replicas >= 1, f"min_replicas={min_replicas!r} must be an int "
                "of at least 1", "Pass the fewest replica groups a step may commit with, e.g. 1.")
        self.server = LighthouseServer(bind=f"{url_host(self.host)}:{port}", min_replicas=min_replicas,
                                       join_timeout_ms=join_timeout_ms, quorum_tick_ms=quorum_tick_ms,
                                       heartbeat_timeout_ms=heartbeat_timeout_ms)
        self.port = int(self.server.address().rsplit(":", 1)[1])

    def address(self) -> str:
        """What replica groups are given as `lighthouse_addr` (the address, not this host's name)."""
        return f"http://{url_host(self.host)}:{self.port}"

    def shutdown(self) -> None:
        self.server.shutdown()
