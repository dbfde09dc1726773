"""What the kernel says of processes (``/proc``): start times, stopped states, and where a pid
means something (host, boot, PID namespace). One parser of ``/proc/PID/stat``; standard library only."""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass


def boot_id() -> str | None:
    """The kernel's boot id (changes at every boot), None where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            return handle.read().strip() or None
    except OSError:
        return None


def pid_namespace() -> int | None:
    """The inode of this process's PID namespace: pids mean something only inside one. None without /proc."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


@dataclass(frozen=True, slots=True)
class Place:
    """Where a pid means something: one host, one boot, one PID namespace."""

    host: str
    boot_id: str | None
    pid_ns: int | None

    @classmethod
    def here(cls) -> Place:
        return cls(socket.gethostname(), boot_id(), pid_namespace())


def process_stat(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` from the third on (the state first), or None without such a
    process or /proc. The command name (field 2) may hold spaces and parentheses: fields are counted
    after its last ')'."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rpartition(b")")[2].split() or None
    except OSError:
        return None


def process_start_time(pid: int) -> int | None:
    """When the live process ``pid`` started (clock ticks since boot); None if it does not exist, is
    a zombie nobody has reaped yet or is dying (states Z and X: as dead as it will get), or no /proc."""
    fields = process_stat(pid)
    try:
        if fields is None or fields[0] in (b"Z", b"X", b"x"):
            return None
        return int(fields[19])  # field 22 of the whole line
    except (IndexError, ValueError):
        return None


def process_stopped(pid: int) -> bool:
    """Is the process ``pid`` stopped (SIGSTOP, a debugger: states T and t)? False when unknown."""
    fields = process_stat(pid)
    return fields is not None and fields[0] in (b"T", b"t")


def alive(pid: int | None, started: int | None) -> bool:
    """Is ``pid`` still the live process that started at ``started``?"""
    return pid is not None and started is not None and process_start_time(pid) == started


def holders(inode: str, limit: int = 100_000) -> list[int]:
    """The pids that hold a descriptor of the file ``inode`` (``DEV:INO``), as far as this process may
    look into ``/proc/PID/fd`` (and at most ``limit`` descriptors looked at: a crowded node's scan is
    bounded). For an operator's line only; never a proof of anything."""
    found: list[int] = []
    looked = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                for fd in os.scandir(f"/proc/{entry.name}/fd"):
                    looked += 1
                    if looked > limit:
                        return found
                    with contextlib.suppress(OSError):
                        info = os.stat(fd.path)
                        if f"{info.st_dev}:{info.st_ino}" == inode:
                            found.append(int(entry.name))
                            break
    return found


def command_name(pid: int) -> str | None:
    """The command name of ``pid`` (``/proc/PID/comm``), None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as handle:
            return handle.read().strip().decode("utf-8", "replace")[:64] or None
    except OSError:
        return None
