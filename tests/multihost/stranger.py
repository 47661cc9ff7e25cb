"""Not a rank: a stranger on a job's ports while the job sets up (issue 59's "a stranger
connecting to the rendezvous or the data ports").

``python stranger.py SECONDS TARGET ...``, each TARGET ``HOST:PORT``, ``HOST:FIRST-LAST``
or ``HOST:@FILE`` (the port, once FILE holds it). For SECONDS each port, in a thread of
its own, is tried again and again; each time it answers it gets a connection held
silent and one sent garbage (and held), and the first time also one saying a
well-formed hello under a wrong key (a rendezvous client's, then a rank's). Every
connection stays open until the end, so the job sets up beside them. Prints one JSON
line: how many times each port answered, and any that took a wrong-key hello (none may).
"""
import json
import os
import socket
import sys
import threading
import time

from horolite.transport import tcp_hello
from horolite.world.rendezvous import RendezvousClient, RendezvousError

WRONG_KEY = os.urandom(32)


def targets(args):
    for arg in args:
        host, ports = arg.rsplit(":", 1)
        if ports.startswith("@"):
            yield host, ports[1:]
            continue
        first, _, last = ports.partition("-")
        for port in range(int(first), int(last or first) + 1):
            yield host, port


def port_of(port, end):
    """The port, or the one its file names once it does (None if it never does)."""
    while isinstance(port, str) and time.monotonic() < end:
        try:
            with open(port) as f:
                return int(f.read())
        except (OSError, ValueError):
            time.sleep(0.02)
    return port if isinstance(port, int) else None


def wrong_key_accepted(host, port):
    """Whether a hello under a wrong key got in, as a rendezvous client or as a rank."""
    try:
        RendezvousClient(host, port, WRONG_KEY, timeout=0.5).close()
        return True
    except (RendezvousError, OSError):
        pass
    try:
        tcp_hello.connect(host, port, 0, 1, 0, WRONG_KEY, 0.5).close()
        return True
    except (tcp_hello.HelloRefused, OSError):
        return False


def pester(host, port, end, held, reached, accepted):
    port = port_of(port, end)
    while port is not None and time.monotonic() < end:
        try:
            silent = socket.create_connection((host, port), timeout=0.2)
            garbage = socket.create_connection((host, port), timeout=0.2)
            garbage.sendall(os.urandom(64) + b"\xff" * 64)
        except OSError:
            time.sleep(0.05)
            continue  # nothing listens there (yet, or any more)
        held += [silent, garbage]
        name = f"{host}:{port}"
        reached[name] = reached.get(name, 0) + 1
        if reached[name] == 1:  # (beside this loop, which goes on)
            threading.Thread(target=lambda: wrong_key_accepted(host, port) and
                             accepted.append(name)).start()
        time.sleep(0.05)


def main():
    seconds = float(sys.argv[1])
    end = time.monotonic() + seconds
    held, reached, accepted = [], {}, []
    threads = [threading.Thread(target=pester, args=(host, port, end, held, reached, accepted))
               for host, port in targets(sys.argv[2:])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for t in threading.enumerate():  # the wrong-key hellos
        if t is not threading.current_thread():
            t.join()
    print(json.dumps({"reached": reached, "wrong_key_accepted": accepted}), flush=True)
    for sock in held:
        sock.close()


if __name__ == "__main__":
    main()
