#!/usr/bin/env bash
# `make images`: both Dockerfiles built on this machine without a Docker engine, and pushed to a registry on
# 127.0.0.1 (see docs/testing.md, "Images"). Needs root and Debian's mmdebstrap, buildah, runc and docker-registry
# (`make images` installs them).
#
#   base      a Python 3.11 bookworm root filesystem from Debian's packages (mmdebstrap), a venv first on PATH
#             (where the official python image has /usr/local); what the Dockerfiles get as --build-arg BASE.
#   platform  Dockerfile, FROM that base, in two steps like the trainer: its pins (`deps`), then its code.
#   trainer   trainer_image/Dockerfile, FROM that base: the CPU path of the same torch wheel (no CUDA base here).
#
# Every image is tagged with a hash of its inputs (the base's: this script's base recipe; the others': their
# Dockerfile, every file of the build context they copy, and the base's tag), kept in buildah's storage under
# $KEMBED_CACHE/containers and skipped when that tag exists: a warm run takes seconds. The storage driver is overlay
# where the kernel has it: a layer is its own directory, so a FROM, a commit or a push never copies the layers
# below it (vfs, the fallback, copies the whole image at each). The registry (distribution's, from Debian's
# docker-registry package) serves $KEMBED_CACHE/registry on a free port for the push and stops again;
# `tests/images/registry.py` starts it for the tests.
#
# Package downloads inside the builds need this machine's CA certificates (its egress goes through a proxy with
# a local CA). They are bind-mounted for the build's RUN steps only (-v, like a secret): the layers keep the
# base's own Debian bundle, and the script checks that no published image differs from it.
#
#   IMAGES="platform" bash tests/images/build.sh     # only some of them (default: base platform trainer)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"

cache="${KEMBED_CACHE:-$HOME/.cache/kembed}"
images="${IMAGES:-base platform trainer}"
export BUILDAH_ISOLATION=chroot
driver=vfs
grep -qw overlay /proc/filesystems && driver=overlay
# One storage per driver: buildah refuses a root made by another driver.
storage=(--root "$cache/containers/$driver" --runroot "$cache/containers/run-$driver" --storage-driver "$driver")
bah() { buildah "${storage[@]}" "$@"; }
log() { printf '[images] %s\n' "$*" >&2; }
seconds() { date +%s; }

[[ "$(id -u)" == 0 ]] || { log "needs root (buildah with chroot isolation, no user namespaces)"; exit 1; }
for tool in mmdebstrap buildah runc docker-registry; do
  command -v "$tool" >/dev/null || { log "$tool missing: apt-get install -y mmdebstrap buildah runc docker-registry"; exit 1; }
done
mkdir -p "$cache/containers" "$cache/images"
# One build at a time on this machine (test runs of several worktrees may call this at once): the others wait.
exec 9>"$cache/images/.build.lock"
flock 9

exists() { bah inspect --type image "$1" >/dev/null 2>&1; }

# hash_inputs FILE...: one hash over the named files' paths and contents (directories: every file below them,
# caches left out), so any edit to what an image copies gives it a new tag.
hash_inputs() {
  (cd "$repo" && find "$@" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | LC_ALL=C sort -z |
    xargs -0 sha256sum) | sha256sum | cut -c1-16
}

# ---- base ---------------------------------------------------------------------------------------------------------
# The recipe's every input is in these lines; change one and the base (and so every image on it) is rebuilt.
base_suites=(bookworm bookworm-updates bookworm-security)
base_packages=python3,python3-venv,ca-certificates,passwd
base_recipe="mmdebstrap --variant=apt $base_packages ${base_suites[*]} venv=/opt/venv $(mmdebstrap --version)"
base_tag="localhost/kembed/base:$(printf '%s' "$base_recipe" | sha256sum | cut -c1-16)"

build_base() {
  exists "$base_tag" && { log "base $base_tag cached"; return; }
  local start tar c
  start=$(seconds)
  tar="$(mktemp -d "$cache/images/.base.XXXX")/rootfs.tar"
  # Debian's own mirrors (plain http, signed by the archive keyring): no CA of this machine involved. Manuals,
  # translations and docs are left out, as the official slim images do (copyright files stay).
  mmdebstrap --variant=apt --include="$base_packages" \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/info/*' \
    --customize-hook='chroot "$1" python3 -m venv /opt/venv' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    bookworm "$tar" \
    "deb http://deb.debian.org/debian bookworm main" \
    "deb http://deb.debian.org/debian bookworm-updates main" \
    "deb http://deb.debian.org/debian-security bookworm-security main"
  c=$(bah from scratch)
  bah add "$c" "$tar" /
  bah config --env PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --cmd python3 "$c"
  bah commit --rm "$c" "$base_tag" >/dev/null
  rm -rf "$(dirname "$tar")"
  log "built base $base_tag in $(( $(seconds) - start )) s"
}

# ---- the two Dockerfiles --------------------------------------------------------------------------------------------
# An image's inputs: its Dockerfile and every source its COPY lines name (read from the Dockerfile itself).
copied() {  # DOCKERFILE
  printf '%s\n' "$1"
  sed -n 's/^COPY[[:space:]]\+//p' "$repo/$1" | awk '{for (i = 1; i < NF; i++) print $i}'
}
mapfile -t platform_inputs < <(copied Dockerfile)
mapfile -t trainer_inputs < <(copied trainer_image/Dockerfile)
# Each Dockerfile's `deps` stage (the pins it installs; for the trainer, gigabytes of torch) is an image of its own,
# rebuilt only when what it installs can change: the requirements of the project and of the image's extras in
# pyproject.toml (not the rest of that file), the pins, or that stage's own lines. A change to kembed's code, the
# README or the final stage rebuilds the thin final stage alone.
requirements() {  # EXTRA...
  python3 -c "import sys, tomllib; p = tomllib.load(open(sys.argv[1], 'rb'))['project']; \
print('\n'.join(p['dependencies'] + [r for extra in sys.argv[2:] for r in p['optional-dependencies'][extra]]))" \
    "$repo/pyproject.toml" "$@"
}
deps_tag() {  # NAME DOCKERFILE EXTRA...
  local name="$1" dockerfile="$2"; shift 2
  printf 'localhost/kembed/%s-deps:%s' "$name" "$(printf '%s %s %s %s' "$base_tag" "$(hash_inputs constraints.txt)" \
    "$(requirements "$@" | sha256sum)" "$(sed '/^FROM \${DEPS}/,$d' "$repo/$dockerfile" | sha256sum)" | sha256sum | cut -c1-16)"
}

image_tag() {  # NAME INPUTS...
  local name="$1"; shift
  printf 'localhost/kembed/%s:%s' "$name" "$(printf '%s %s' "$base_tag" "$(hash_inputs "$@")" | sha256sum | cut -c1-16)"
}

# The build's view of this machine's CAs: its bundle, bind-mounted read-only over the base's own for RUN steps
# only, never part of a layer. (Debian's pip reads the system bundle. A mount over a path the base lacks would
# leave an empty stub in the layer, so nothing else is mounted.)
ca_mounts() {
  printf -- '-v\n%s\n' "/etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro"
}

build_dockerfile() {  # NAME DOCKERFILE TAG [BUD ARGUMENTS...]
  local name="$1" dockerfile="$2" tag="$3" start mounts
  shift 3
  exists "$tag" && { log "$name $tag cached"; return; }
  start=$(seconds)
  mapfile -t mounts < <(ca_mounts)
  (cd "$repo" && bah bud --pull=never --layers=false --build-arg "BASE=$base_tag" "${mounts[@]}" "$@" \
    -f "$dockerfile" -t "$tag" .)
  log "built $name $tag in $(( $(seconds) - start )) s"
  [[ "$name" == *-deps ]] || check_no_build_cas "$tag"
}

# The image's CA bundles must be the base's: the machine's own CAs were only mounted during the build. Checked once,
# right after a build (under vfs a working container is a whole copy of the image: a minute or more for the trainer).
check_no_build_cas() {  # TAG
  local c mnt bc base_mnt file
  c=$(bah from --pull=never "$1"); mnt=$(bah mount "$c")
  bc=$(bah from --pull=never "$base_tag"); base_mnt=$(bah mount "$bc")
  for file in etc/ssl/certs/ca-certificates.crt $(cd "$base_mnt" && find opt/venv/lib -name cacert.pem); do
    [[ -e "$mnt/$file" ]] || continue
    if ! cmp -s "$mnt/$file" "$base_mnt/$file"; then
      log "$1: /$file differs from the base's (build-time CAs left in the image)"; bah rm "$c" "$bc" >/dev/null; exit 1
    fi
  done
  bah rm "$c" "$bc" >/dev/null
}

case " $images " in *" base "*|*" platform "*|*" trainer "*) build_base ;; esac
platform_deps_tag=$(deps_tag platform Dockerfile api operator)
platform_tag=$(image_tag platform "${platform_inputs[@]}")
trainer_deps_tag=$(deps_tag trainer trainer_image/Dockerfile trainer)
trainer_tag=$(image_tag trainer "${trainer_inputs[@]}")
case " $images " in *" platform "*)
  build_dockerfile platform-deps Dockerfile "$platform_deps_tag" --target deps
  build_dockerfile platform Dockerfile "$platform_tag" --build-arg "DEPS=$platform_deps_tag" ;; esac
case " $images " in *" trainer "*)
  build_dockerfile trainer-deps trainer_image/Dockerfile "$trainer_deps_tag" --target deps
  build_dockerfile trainer trainer_image/Dockerfile "$trainer_tag" --build-arg "DEPS=$trainer_deps_tag" ;; esac

# ---- the registry on 127.0.0.1 ----------------------------------------------------------------------------------------
# distribution's registry as Debian packages it; its storage persists under $KEMBED_CACHE/registry, so a registry
# started later (a test) serves what was pushed here.
registry_bin="$(command -v docker-registry)"

push_all() {  # TAG...: to a registry started on a free port for the push, stopped after
  local port config tag start
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  config="$cache/images/registry.yaml"
  printf 'version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: %s\nhttp:\n  addr: 127.0.0.1:%s\n' \
    "$cache/registry" "$port" > "$config"
  # Without the build lock (fd 9): a registry left running must not hold every later build back.
  "$registry_bin" serve "$config" > "$cache/images/registry.log" 2>&1 9>&- &
  registry_pid=$!  # global: the trap runs after this function's locals are gone
  trap 'kill "$registry_pid" 2>/dev/null || true' EXIT
  for _ in $(seq 50); do curl -fs "http://127.0.0.1:$port/v2/" >/dev/null && break; sleep 0.2; done
  for tag in "$@"; do
    local ref="${tag#localhost/}"
    if curl -fsI -H 'Accept: application/vnd.oci.image.manifest.v1+json' \
        "http://127.0.0.1:$port/v2/${ref%:*}/manifests/${ref##*:}" >/dev/null; then
      log "$ref already in the registry"; continue
    fi
    start=$(seconds)
    # Uncompressed: gzip of the trainer's 5 GB took ~11 of a cold run's minutes on one core, for a registry whose
    # only clients pull over the loopback (tests/cluster/oci.py reads plain, gzip and zstd layers).
    bah push --disable-compression --tls-verify=false "$tag" "docker://127.0.0.1:$port/${tag#localhost/}" >/dev/null
    log "pushed ${tag#localhost/} in $(( $(seconds) - start )) s"
  done
  kill "$registry_pid"; wait "$registry_pid" 2>/dev/null || true
  trap - EXIT
  prune_registry "$config" "$@"
}

# The registry keeps every tag pushed to it, and the trainer's deps layer is gigabytes: each repository keeps its
# newest $registry_keep tags (other worktrees' recent builds) and this tree's, and the registry's own garbage
# collector then deletes the blobs no kept tag needs. A test run still reading a removed tag would fail its pull, so
# the count is generous.
registry_keep=4
prune_registry() {  # CONFIG TAG...: the registry stopped
  local config="$1" tags repository old
  shift
  local current=" ${*#localhost/} "  # this tree's tags as the registry names them: " kembed/NAME:HASH ... "
  for tags in "$cache"/registry/docker/registry/v2/repositories/kembed/*/_manifests/tags; do
    [[ -d "$tags" ]] || continue
    repository="kembed/$(basename "$(dirname "$(dirname "$tags")")")"
    for old in $(ls -1t "$tags" | tail -n +$((registry_keep + 1))); do
      [[ "$current" == *" $repository:$old "* ]] || rm -rf "${tags:?}/$old"
    done
  done
  "$registry_bin" garbage-collect --delete-untagged "$config" > "$cache/images/registry-gc.log" 2>&1 ||
    log "registry garbage collection failed (see $cache/images/registry-gc.log); the storage keeps its blobs"
}

built=()
for tag in $platform_tag $trainer_tag; do exists "$tag" && built+=("$tag"); done
[[ ${#built[@]} -gt 0 ]] && push_all "${built[@]}"

# The builds of older inputs go once a newer one is here (each trainer's final stage is a layer on its deps; under
# vfs, a whole 5.6 GB copy); a worktree that still needs one rebuilds it (for the trainer, only its thin code stage).
prune() {  # NAME CURRENT-TAG
  local other
  exists "$2" || return 0
  for other in $(bah images --format '{{.Name}}:{{.Tag}}' --filter "reference=localhost/kembed/$1" 2>/dev/null); do
    [[ "${other%:*}" == "localhost/kembed/$1" && "$other" != "$2" ]] && { bah rmi "$other" >/dev/null 2>&1 && log "removed $other (older inputs)"; } || true
  done
}
prune platform "$platform_tag"
prune platform-deps "$platform_deps_tag"
prune trainer "$trainer_tag"
prune trainer-deps "$trainer_deps_tag"

# What the tests read: the tags of this tree's images (the registry's repository is the tag without localhost/).
tags_json=$(printf '{"base": "%s", "platform": "%s", "trainer": "%s"}' "$base_tag" "$platform_tag" "$trainer_tag")
printf '%s\n' "$tags_json" > "$cache/images/tags.json"
for tag in $base_tag $platform_tag $trainer_tag; do
  if exists "$tag"; then log "$(bah images --format '{{.Name}}:{{.Tag}} {{.Size}}' "$tag")"; fi
done
# The last line of stdout: the tags, for tests/images/registry.py (tags.json is the last run of any tree).
printf '%s\n' "$tags_json"
