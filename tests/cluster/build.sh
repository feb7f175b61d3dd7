#!/usr/bin/env bash
# Builds the test control plane from Go modules: etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
# kubectl, kwok and helm. Each lands in $KEMBED_CACHE/bin/<component>-<version>/ and is skipped when already there,
# so a warm run takes about a second. Nothing is written inside the repository.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"

cache="${KEMBED_CACHE:-$HOME/.cache/kembed}"
export GOMODCACHE="$cache/go/mod" GOCACHE="$cache/go/build"
# The toolchain on the machine builds everything: never download another one. Static binaries, no libc surprises.
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=readonly -trimpath"
bin_root="$cache/bin"

log() { printf '[cluster-bins] %s\n' "$*" >&2; }

# needs_build COMPONENT VERSION: true unless $bin_root/COMPONENT-VERSION/COMPONENT exists.
needs_build() { [[ ! -x "$bin_root/$1-$2/$1" ]]; }

# publish COMPONENT VERSION TMPDIR: moves a finished build into place in one rename, so a build
# interrupted half-way never looks cached.
publish() {
  rm -rf "$bin_root/$1-$2"
  chmod 755 "$3"  # mktemp -d made it private
  mv "$3" "$bin_root/$1-$2"
  log "built $1 $2"
}

module_version() { (cd "$1" && go list -m -f '{{.Version}}' "$2"); }

check_pin() {
  local got
  got="$(module_version "$1" "$2")"
  if [[ "$got" != "$3" ]]; then
    log "versions.env says $3 but $1/go.mod requires $2 $got"; exit 1
  fi
}

mkdir -p "$bin_root"

# etcd: the server module has replace directives, so `go install` of it fails; go/etcd is a wrapper module
# that requires it as a tool.
if needs_build etcd "$ETCD_VERSION"; then
  check_pin "$here/go/etcd" go.etcd.io/etcd/server/v3 "$ETCD_VERSION"
  tmp="$(mktemp -d "$bin_root/.etcd.XXXX")"
  (cd "$here/go/etcd" && go build -ldflags "-s -w" -o "$tmp/etcd" go.etcd.io/etcd/server/v3)
  publish etcd "$ETCD_VERSION" "$tmp"
fi

# Kubernetes: k8s.io/kubernetes replaces its k8s.io/* staging modules with ./staging paths; go/k8s replaces each
# with its published v0.X.Y instead. The version ldflags make /version (and so helm's kubeVersion checks) right.
k8s_cmds=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
k8s_missing=0
for c in "${k8s_cmds[@]}"; do needs_build "$c" "$KUBERNETES_VERSION" && k8s_missing=1; done
if (( k8s_missing )); then
  check_pin "$here/go/k8s" k8s.io/kubernetes "$KUBERNETES_VERSION"
  minor="${KUBERNETES_VERSION#v1.}"; minor="${minor%%.*}"
  ldflags="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $p.gitVersion=$KUBERNETES_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
  done
  tmp="$(mktemp -d "$bin_root/.k8s.XXXX")"
  # One go build for all four shares the compiled packages between them.
  (cd "$here/go/k8s" && go build -tags selinux,notest,grpcnotrace -ldflags "$ldflags" -o "$tmp/" \
    "${k8s_cmds[@]/#/k8s.io/kubernetes/cmd/}")
  for c in "${k8s_cmds[@]}"; do
    mkdir -p "$tmp/$c.d" && mv "$tmp/$c" "$tmp/$c.d/$c"
    publish "$c" "$KUBERNETES_VERSION" "$tmp/$c.d"
  done
  rmdir "$tmp"
fi

# kwok and helm have no replace directives: a plain `go install pkg@version` works.
install_tool() {  # COMPONENT VERSION PACKAGE [LDFLAGS]
  needs_build "$1" "$2" || return 0
  local tmp
  tmp="$(mktemp -d "$bin_root/.$1.XXXX")"
  GOFLAGS=-trimpath GOBIN="$tmp" go install -ldflags "-s -w ${4:-}" "$3@$2"
  publish "$1" "$2" "$tmp"
}
install_tool kwok "$KWOK_VERSION" sigs.k8s.io/kwok/cmd/kwok
install_tool helm "$HELM_VERSION" helm.sh/helm/v3/cmd/helm "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"

log "all binaries present under $bin_root"
