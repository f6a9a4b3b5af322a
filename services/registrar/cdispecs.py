"""CDI spec files of prepared claims: written atomically, removed on unprepare, rebuilt from the ledger.

The CDI directory (default /var/run/cdi) is often a tmpfs: a reboot empties it while the claims stay
prepared. Nothing here is the truth: the ledger is. At start the registrar asks the allocator for its
folded state and writes the spec of every prepared claim again (and removes our files for claims that
are no longer prepared), so a wiped directory loses nothing.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from libs.cdi import claim_of_spec_file, encode_spec, spec_file_name, spec_for_claim
from libs.events.schema import ContainerResponse

__all__ = ["CdiSpecs"]


class CdiSpecs:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, claim_uid: str) -> Path:
        return self.directory / spec_file_name(claim_uid)

    def write(self, claim_uid: str, response: ContainerResponse, *, pod_uid: str, claim: str) -> Path:
        """Write (or replace) the claim's spec: temporary file, rename, so a runtime reading the
        directory never sees half a file.

        No fsync (of the file or the directory): the spec is not the record, the ledger is, and the
        grant is fsynced there before the kubelet hears of it. What only a power loss could take
        (the page cache) the registrar puts back at its start, before it serves the DRA socket: it
        rewrites the spec of every claim the ledger holds as prepared, torn or missing ones included.
        A container started meanwhile fails on an unresolvable CDI device and is retried, as after a
        reboot that emptied a tmpfs /var/run/cdi (the usual case, where fsync does nothing anyway)."""
        target = self.path(claim_uid)
        data = encode_spec(spec_for_claim(claim_uid, response, pod_uid=pod_uid, claim=claim))
        try:
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=".json")
        except FileNotFoundError:  # the directory itself is gone (a wiped tmpfs): made again
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), 0o644)
                f.write(data)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return target

    def remove(self, claim_uid: str) -> bool:
        try:
            self.path(claim_uid).unlink()
            return True
        except FileNotFoundError:
            return False

    def present(self) -> set[str]:
        """Claim UIDs that have a spec file of ours."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return set()
        return {uid for n in names if (uid := claim_of_spec_file(n)) is not None}

    def rebuild(self, prepared: dict[str, tuple[ContainerResponse, str, str]]) -> tuple[int, int]:
        """Make the directory hold exactly the specs of ``prepared`` (claim uid -> response, pod uid,
        ns/name); (written, removed)."""
        for uid, (response, pod_uid, claim) in prepared.items():
            self.write(uid, response, pod_uid=pod_uid, claim=claim)
        stale = self.present() - set(prepared)
        for uid in stale:
            self.remove(uid)
        return len(prepared), len(stale)
