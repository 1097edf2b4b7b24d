"""The server's listening socket, bound before the model loads: a port in use (or a host that
is not this machine's) is then an error at once, not after seconds of loading; uvicorn serves
on the socket once the engine is up."""

from __future__ import annotations

import errno
import socket

from outpace.errors import ConfigError


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (not yet listening: a client that connects before the
    engine is up is refused, as before any socket exists). SO_REUSEADDR as uvicorn sets it,
    so a port left in TIME_WAIT by a server just stopped is not "in use". A port held by
    another socket is a ConfigError naming `port`."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"can't listen on {host}: {e.strerror}; pass an address or name of "
                          f"this machine", option="host") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(f"{host}:{port} is in use (another server holds it); pick "
                              f"another port or stop what holds it", option="port") from None
        raise ConfigError(f"can't listen on {host}:{port}: {e.strerror or e}",
                          option="host") from None
    return sock
