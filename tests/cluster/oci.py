"""Containers from images for the test kubelet: pulls from a registry's /v2 API, unpacks layers, runs with runc.

- Pull: the manifest (an index resolves to linux/amd64) and config over plain HTTP from a registry on this machine
  (`make images` pushes there; tests/images/registry.py serves it). Each layer is streamed through GNU tar into a
  directory of its own, checked against its digest, and kept under `<cache>/layers/<digest>` (shared by every image
  and test run that uses it: a new trainer build unpacks only its new layer).
- Root filesystem: an overlay mount of the image's layer directories (whiteouts turned into overlayfs' own) with a
  fresh upper directory for each container start, as a container runtime gives each container a writable layer.
- Run: `runc run` in the foreground with a bundle made from the image config and the pod spec (see
  `runtime_config`); its exit status is the container's (128+N for a signal), its stdout/stderr the log.

Errors a kubelet reports as ErrImagePull (no such tag or repository, registry unreachable, a bad digest) are raised
as `ImagePullError` with a message that says which.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pathlib
import re
import shutil
import stat
import subprocess
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass

MANIFEST_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
INDEX_TYPES = MANIFEST_TYPES[0], MANIFEST_TYPES[2]
# A reference this kubelet pulls: a registry on this machine (`127.0.0.1:PORT/...` or `localhost:PORT/...`).
# Every other image name runs in process mode (tests/cluster/kubelet.py).
LOCAL_REFERENCE = re.compile(
    r"(?P<host>(?:127\.0\.0\.1|localhost):\d+)/(?P<repository>[a-z0-9]+(?:[._/-][a-z0-9]+)*)"
    r"(?::(?P<tag>[\w][\w.-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?"
)
# Room for two builds of the trainer's dependency layer (5 GB each) and the small layers around them.
LAYER_CACHE_BYTES = 12 * 2**30
DEFAULT_CAPABILITIES = [  # what containerd and CRI-O grant a container by default
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW", "CAP_SETGID",
    "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL",
    "CAP_AUDIT_WRITE",
]


class ImagePullError(Exception):
    """The image cannot be pulled; the message is what the pod's waiting state shows."""


@dataclass(frozen=True)
class Reference:
    registry: str
    repository: str
    tag: str | None
    digest: str | None

    @classmethod
    def parse(cls, image: str) -> Reference | None:
        """The reference when it names a registry on this machine, else None (a process-mode image)."""
        match = LOCAL_REFERENCE.fullmatch(image)
        if not match:
            return None
        tag = match.group("tag") or (None if match.group("digest") else "latest")
        return cls(match.group("host"), match.group("repository"), tag, match.group("digest"))


@dataclass(frozen=True)
class Image:
    digest: str  # the manifest's
    layers: list[pathlib.Path]  # unpacked, lowest first
    config: dict  # the image config's `config` (Env, Entrypoint, Cmd, WorkingDir, User)


class ImageStore:
    """Pulled layers under `root` (kept across runs; the same layer is unpacked once). Each new layer makes room
    for itself: past `max_bytes`, the layers pulled least recently go, except those a container's overlay mounts
    now (every build of the trainer's dependencies is a new 5 GB layer, and nothing else would ever remove one)."""

    def __init__(self, root: pathlib.Path, max_bytes: int = LAYER_CACHE_BYTES):
        self.root = root
        self.max_bytes = max_bytes
        (root / "layers").mkdir(parents=True, exist_ok=True)

    def pull(self, image: str) -> Image:
        reference = Reference.parse(image)
        if reference is None:
            raise ImagePullError(f"{image!r} is not on a registry of this machine (127.0.0.1:PORT/...)")
        manifest, digest = self._manifest(reference, reference.digest or reference.tag)
        if manifest.get("mediaType") in INDEX_TYPES or "manifests" in manifest:
            chosen = next((m for m in manifest["manifests"] if (m.get("platform") or {}).get("os") == "linux"
                           and m["platform"].get("architecture") == "amd64"), None)
            if chosen is None:
                raise ImagePullError(f"{image}: no linux/amd64 image in its index")
            manifest, digest = self._manifest(reference, chosen["digest"])
        config = json.loads(self._blob(reference, manifest["config"]["digest"]))
        wanted = [self._layer_dir(layer["digest"]) for layer in manifest["layers"]]
        layers = [self._layer(reference, layer["digest"], layer.get("mediaType", ""), keep=wanted)
                  for layer in manifest["layers"]]
        return Image(digest, layers, config.get("config") or {})

    # -- the registry's /v2 API --
    def _get(self, reference: Reference, path: str, accept: str | None = None):
        url = f"http://{reference.registry}/v2/{reference.repository}/{path}"
        request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
        try:
            return urllib.request.urlopen(request, timeout=30)
        except urllib.error.HTTPError as error:
            detail = error.read(2000).decode(errors="replace")
            with contextlib.suppress(ValueError, KeyError, IndexError):
                detail = json.loads(detail)["errors"][0]["message"]
            raise ImagePullError(f"{reference.registry}/{reference.repository}/{path}: {error.code} {detail}") from None
        except OSError as error:  # refused, reset, timed out
            raise ImagePullError(f"registry {reference.registry} unreachable: {error}") from None

    def _manifest(self, reference: Reference, tag_or_digest: str) -> tuple[dict, str]:
        with self._get(reference, f"manifests/{tag_or_digest}", ", ".join(MANIFEST_TYPES)) as response:
            body = response.read()
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        if tag_or_digest.startswith("sha256:") and digest != tag_or_digest:
            raise ImagePullError(f"manifest {tag_or_digest} arrived with digest {digest}")
        return json.loads(body), digest

    def _blob(self, reference: Reference, digest: str) -> bytes:
        with self._get(reference, f"blobs/{digest}") as response:
            body = response.read()
        if "sha256:" + hashlib.sha256(body).hexdigest() != digest:
            raise ImagePullError(f"blob {digest} does not match its digest")
        return body

    def _layer_dir(self, digest: str) -> pathlib.Path:
        return self.root / "layers" / digest.replace(":", "-")

    def _layer(self, reference: Reference, digest: str, media_type: str, *, keep: list[pathlib.Path]) -> pathlib.Path:
        """The layer unpacked into its own directory, overlayfs whiteouts in place of the OCI `.wh.` files. Room
        is made for a new one among the layers not in `keep` (the rest of the image being pulled)."""
        target = self._layer_dir(digest)
        with open(self.root / "layers" / ".lock", "w") as lock:  # one unpacker of a layer at a time, any process
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not target.is_dir():
                scratch = pathlib.Path(tempfile.mkdtemp(prefix=".unpack-", dir=self.root / "layers"))
                try:
                    size = self._unpack(reference, digest, media_type, scratch)
                    self._make_room(size, keep)
                    scratch.rename(target)
                    _size_file(target).write_text(str(size))
                finally:
                    shutil.rmtree(scratch, ignore_errors=True)
            os.utime(target)  # pulled now: the last to go
        return target

    def _make_room(self, needed: int, keep: list[pathlib.Path]) -> None:
        """Removes the least recently pulled layers, but those in `keep`, until `needed` more bytes fit under
        `max_bytes`."""
        layers = sorted((p for p in (self.root / "layers").glob("sha256-*") if p.is_dir()),
                        key=lambda p: p.stat().st_mtime)
        sizes = {layer: _layer_size(layer) for layer in layers}
        total = sum(sizes.values())
        mounted = _mounted_lower_dirs()
        for layer in layers:
            if total + needed <= self.max_bytes:
                return
            if layer in keep or str(layer) in mounted:
                continue
            _size_file(layer).unlink(missing_ok=True)
            shutil.rmtree(layer, ignore_errors=True)
            total -= sizes[layer]

    def _unpack(self, reference: Reference, digest: str, media_type: str, directory: pathlib.Path) -> int:
        """Unpacks the layer into `directory`; the bytes it takes there."""
        checksum = hashlib.sha256()
        # The layer's media type says its compression (tar cannot tell it from a pipe): `make images` pushes
        # uncompressed layers, other pushes gzip (Docker's and OCI's `.tar.gzip`) or zstd.
        if media_type.endswith(("gzip", "tar.gz")):
            decompress = ["--gzip"]
        elif media_type.endswith("zstd"):
            decompress = ["--zstd"]
        elif media_type.endswith((".tar", "layer.v1.tar")) or not media_type:
            decompress = []
        else:
            raise ImagePullError(f"layer {digest}: media type {media_type!r} is not a tar layer")
        # --same-owner and --xattrs as a runtime unpacks (the kubelet is root).
        tar = subprocess.Popen(["tar", "--extract", *decompress, "--same-owner", "--same-permissions",
                                "--numeric-owner", "--xattrs", "--xattrs-include=*", "--no-overwrite-dir",
                                "--directory", str(directory)],
                               stdin=subprocess.PIPE, stderr=subprocess.PIPE)
        with self._get(reference, f"blobs/{digest}") as response:
            try:
                while chunk := response.read(1 << 20):
                    checksum.update(chunk)
                    tar.stdin.write(chunk)
            finally:
                tar.stdin.close()
        error = tar.stderr.read().decode(errors="replace")
        if tar.wait() != 0:
            raise ImagePullError(f"layer {digest}: tar failed: {error[-500:]}")
        if "sha256:" + checksum.hexdigest() != digest:
            raise ImagePullError(f"layer {digest} does not match its digest")
        convert_whiteouts(directory)
        return _layer_size(directory)


def _size_file(layer: pathlib.Path) -> pathlib.Path:
    return layer.with_name(layer.name + ".size")


def _layer_size(layer: pathlib.Path) -> int:
    """Bytes a layer takes on disk: recorded when it was unpacked, else counted (and then recorded)."""
    with contextlib.suppress(OSError, ValueError):
        return int(_size_file(layer).read_text())
    size = sum(os.lstat(os.path.join(parent, name)).st_size
               for parent, _dirs, files in os.walk(layer) for name in files)
    if layer.name.startswith("sha256-"):
        with contextlib.suppress(OSError):
            _size_file(layer).write_text(str(size))
    return size


def _mounted_lower_dirs() -> set[str]:
    """The layer directories some overlay mount of this machine reads now (a container is running on them)."""
    lower: set[str] = set()
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 3 and fields[2] == "overlay":
                for option in fields[3].split(","):
                    if option.startswith("lowerdir="):
                        lower.update(option.removeprefix("lowerdir=").split(":"))
    return lower


def convert_whiteouts(directory: pathlib.Path) -> None:
    """OCI whiteouts (`.wh.NAME`: NAME deleted; `.wh..wh..opq`: the directory's lower contents hidden) as
    overlayfs expresses them: a 0/0 character device, and the `trusted.overlay.opaque` attribute."""
    for parent, _dirs, files in os.walk(directory):
        for name in files:
            if not name.startswith(".wh."):
                continue
            path = os.path.join(parent, name)
            os.unlink(path)
            if name == ".wh..wh..opq":
                os.setxattr(parent, "trusted.overlay.opaque", b"y")
            else:
                os.mknod(os.path.join(parent, name[len(".wh."):]), stat.S_IFCHR | 0o000, os.makedev(0, 0))


# ---- the container's filesystem and runtime config ----------------------------------------------------------------


def mount_rootfs(image: Image, bundle: pathlib.Path) -> pathlib.Path:
    """An overlay of the image's layers with a fresh writable layer under `bundle`; returns the mount point."""
    rootfs, upper, work = bundle / "rootfs", bundle / "upper", bundle / "work"
    unmount_rootfs(bundle)
    for directory in (rootfs, upper, work):
        directory.mkdir(parents=True)
    lower = ":".join(str(layer) for layer in reversed(image.layers))  # overlayfs lists the top layer first
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir={lower},upperdir={upper},workdir={work}",
                    str(rootfs)], check=True, capture_output=True, text=True)
    return rootfs


def unmount_rootfs(bundle: pathlib.Path) -> None:
    rootfs = bundle / "rootfs"
    if rootfs.is_dir() and os.path.ismount(rootfs):
        subprocess.run(["umount", "--lazy", str(rootfs)], check=False, capture_output=True)
    for name in ("rootfs", "upper", "work"):
        shutil.rmtree(bundle / name, ignore_errors=True)


def delete_all(runc_root: pathlib.Path) -> None:
    """Kills and deletes every container runc knows under `runc_root` (those of a kubelet that died)."""
    if not runc_root.is_dir():
        return
    listed = subprocess.run(["runc", "--root", str(runc_root), "list", "--quiet"], capture_output=True, text=True)
    for container in listed.stdout.split():
        subprocess.run(["runc", "--root", str(runc_root), "delete", "--force", container], capture_output=True)


def unmount_all(directory: pathlib.Path) -> None:
    """Unmounts every mount below `directory` (the root filesystems of containers a dead kubelet left)."""
    inside = str(directory.resolve()).rstrip("/") + "/"
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/self/mounts").read_text().splitlines():
            mount_point = line.split()[1].replace("\\040", " ")
            if mount_point.startswith(inside):
                subprocess.run(["umount", "--lazy", mount_point], check=False, capture_output=True)


def passwd_entry(rootfs: pathlib.Path, user: str) -> tuple[int, int, str] | None:
    """(uid, gid, home) of `user` (a name or a UID) in the image's /etc/passwd, None when absent."""
    with contextlib.suppress(OSError):
        for line in (rootfs / "etc" / "passwd").read_text().splitlines():
            fields = line.split(":")
            if len(fields) >= 6 and user in (fields[0], fields[2]):
                return int(fields[2]), int(fields[3]), fields[5]
    return None


def resolve_user(rootfs: pathlib.Path, image_user: str, run_as_user: int | None,
                 run_as_group: int | None) -> tuple[int, int, str]:
    """(uid, gid, home) the way a runtime decides: the pod's runAsUser/runAsGroup win over the image's USER."""
    name, _, group = (image_user or "0").partition(":")
    entry = passwd_entry(rootfs, str(run_as_user) if run_as_user is not None else name)
    if run_as_user is not None:
        uid = run_as_user
    elif name.isdigit():
        uid = int(name)
    elif entry:
        uid = entry[0]
    else:
        raise ValueError(f"the image's user {name!r} is not in its /etc/passwd")
    if run_as_group is not None:
        gid = run_as_group
    elif group.isdigit():
        gid = int(group)
    else:
        gid = entry[1] if entry else uid if run_as_user is not None or name.isdigit() else 0
    return uid, gid, entry[2] if entry else "/"


def runtime_config(*, args: list[str], env: dict[str, str], cwd: str, uid: int, gid: int,
                   supplemental_groups: list[int], hostname: str, rootfs: pathlib.Path, readonly_rootfs: bool,
                   mounts: list[dict]) -> dict:
    """The OCI runtime config (config.json) of one container.

    Host network (no network namespace, as the process mode and `hostNetwork: true`), but its own pid, mount, ipc
    and UTS namespaces; the default capabilities for root, none effective for other users (as containerd does);
    no rlimits, so the process keeps the kubelet's, which are under the host's hard limits."""
    capabilities = DEFAULT_CAPABILITIES
    granted = capabilities if uid == 0 else []
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": uid, "gid": gid, "additionalGids": supplemental_groups},
            "args": args,
            "env": [f"{k}={v}" for k, v in env.items()],
            "cwd": cwd or "/",
            "capabilities": {"bounding": capabilities, "effective": granted, "permitted": granted},
            "noNewPrivileges": uid != 0,
        },
        "root": {"path": str(rootfs), "readonly": readonly_rootfs},
        "hostname": hostname,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            # torch's DataLoader workers and gloo pass tensors through /dev/shm: a real node gives 64 MiB by
            # default and a memory-backed emptyDir on request; 1 GiB keeps the small test jobs clear of it.
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=1g"]},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
             "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
            *mounts,
        ],
        "linux": {
            "namespaces": [{"type": kind} for kind in ("pid", "ipc", "uts", "mount")],
            "maskedPaths": ["/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
                            "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/sys/firmware",
                            "/proc/scsi"],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
        },
    }


def bind_mount(source: pathlib.Path, destination: str, readonly: bool) -> dict:
    return {"destination": destination, "type": "bind", "source": str(source),
            "options": ["rbind", "rprivate", "ro" if readonly else "rw"]}
