#!/usr/bin/env bash
# Builds the tools only the test command needs, each from the Go module proxy, pinned in
# scripts/versions.env and cached by version under $TOOLS_DIR/bin (a stamp per tool):
#   policy-tester   sigstore policy-controller's cmd/tester (evaluates a ClusterImagePolicy)
#   kube-apiserver  k8s.io/kubernetes' API server, and kubectl beside it
#   etcd            go.etcd.io/etcd/server/v3 through a small wrapper module
#   buildkitd       github.com/moby/buildkit's daemon, and buildctl beside it (the builder pool)
#   containerd2     containerd 2.x and ctr2 (opt-in, IMAGEBUILD_WITH_CONTAINERD2=1: bench_time_to_ready only)
#   containerd-stargz-grpc, stargz-rpull, estargz-verify
#                   github.com/containerd/stargz-snapshotter through our wrapper module (scripts/stargz/):
#                   the lazy-pulling snapshotter, a pull client that passes its labels, and a verifier
#
# Usage: scripts/build-test-tools.sh            build what is missing, in the foreground; wait
#                                               for a build another process is running
#        scripts/build-test-tools.sh --detach   start that in the background and return at once
#                                               (bootstrap does this, so the main job never waits
#                                               for these builds)
#        scripts/build-test-tools.sh --check    exit 0 when every tool is present
#
# One build at a time (flock on $RUN_DIR/test-tools.lock): a second caller waits for the first
# and then finds everything present. Builds run at the lowest CPU and I/O priority, so that a
# main job beside them keeps the machine's cores. Each binary is written beside its final name
# and moved into place whole, then stamped: an interrupted build leaves nothing that looks done.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source-path=SCRIPTDIR source=versions.env
source "$SCRIPT_DIR/versions.env"
export PATH="$TOOLS_DIR/bin:$PATH"
STARTED_AT=$SECONDS

log() { printf '[test-tools] %4ss %s\n' "$((SECONDS - STARTED_AT))" "$*"; }
die() { printf '[test-tools] ERROR: %s\n' "$*" >&2; exit 1; }

mkdir -p "$TOOLS_DIR/bin" "$TOOLS_DIR/src" "$STATE_DIR" "$LOG_DIR" "$RUN_DIR"
LOCK="$RUN_DIR/test-tools.lock"
DETACHED_LOG="$LOG_DIR/test-tools.log"

version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]; }

find_go() {
    local candidate ver
    for candidate in "$GO_PREFERRED" "$(command -v go || true)"; do
        [ -n "$candidate" ] && [ -x "$candidate" ] || continue
        ver="$("$candidate" env GOVERSION 2>/dev/null || true)"
        if [ -n "$ver" ] && version_ge "${ver#go}" "$GO_MIN_VERSION"; then
            GO="$candidate"; return 0
        fi
    done
    die "no Go >= $GO_MIN_VERSION found (see scripts/bootstrap.sh)"
}

# present NAME WANT: the binary is there and was stamped by a finished build of WANT.
present() {
    [ -x "$TOOLS_DIR/bin/$1" ] && [ "$(cat "$STATE_DIR/$1.stamp" 2>/dev/null)" = "$2" ]
}

install_built() {  # NAME WANT: moves NAME.partial into place, then stamps it
    mv -f "$TOOLS_DIR/bin/$1.partial" "$TOOLS_DIR/bin/$1"
    printf '%s\n' "$2" >"$STATE_DIR/$1.stamp"
}

# module_tree MODULE@VERSION NAME: a writable copy of that module's source (the module cache is
# read-only), printed as its path.
module_tree() {
    local want="$1" name="$2" dir src
    dir="$(cd / && "$GO" mod download -json "$want" | sed -n 's/^[[:space:]]*"Dir": *"\([^"]*\)".*/\1/p')"
    [ -n "$dir" ] && [ -d "$dir" ] || die "go mod download $want failed"
    src="$TOOLS_DIR/src/$name"
    rm -rf "$src"
    cp -r "$dir" "$src"
    chmod -R u+w "$src"
    printf '%s\n' "$src"
}

GOBUILD=(-trimpath -ldflags=-s\ -w)

# policy-controller's cmd/tester: its go.mod has replace directives, so `go install` refuses it.
build_policy_tester() {
    local want="$POLICY_CONTROLLER_MODULE@$POLICY_CONTROLLER_VERSION" src started=$SECONDS
    present policy-tester "$want" && { log "policy-tester $POLICY_CONTROLLER_VERSION: present"; return; }
    log "policy-tester: go build $want/cmd/tester (about 11 min on 2 cores)"
    src="$(module_tree "$want" "policy-controller-$POLICY_CONTROLLER_VERSION")"
    (cd "$src" && GOFLAGS=-mod=mod "$GO" build "${GOBUILD[@]}" \
        -o "$TOOLS_DIR/bin/policy-tester.partial" ./cmd/tester) || die "building policy-controller's tester failed"
    install_built policy-tester "$want"
    rm -rf "$src"
    log "policy-tester: built in $((SECONDS - started))s"
}

# kube-apiserver and kubectl from k8s.io/kubernetes. Its go.mod replaces the k8s.io/* staging
# modules with ./staging/..., which the module zip leaves out: point each replace at the
# published module of the same minor (v0.X.Y for v1.X.Y), drop vendor/ and go.work.
build_kubernetes() {
    # The stamp names the version flags too: a binary built without them says v0.0.0-master.
    local want="$KUBERNETES_MODULE@$KUBERNETES_VERSION" src started=$SECONDS staging minor flags pkg
    if present kube-apiserver "$want +version" && present kubectl "$want +version"; then
        log "kube-apiserver, kubectl $KUBERNETES_VERSION: present"; return
    fi
    staging="v0.${KUBERNETES_VERSION#v1.}"
    minor="${KUBERNETES_VERSION#v1.}"; minor="${minor%%.*}"
    # What `hack/lib/version.sh` stamps in a release build; kubectl refuses a server (and itself)
    # reporting the module zip's placeholder version.
    flags="-s -w"
    for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        flags="$flags -X $pkg.gitVersion=$KUBERNETES_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
        flags="$flags -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
    done
    log "kubernetes: go build $want ./cmd/kube-apiserver ./cmd/kubectl (about 15 min on 2 cores)"
    src="$(module_tree "$want" "kubernetes-$KUBERNETES_VERSION")"
    rm -rf "$src/vendor" "$src"/go.work*
    # => ./staging/src/k8s.io/api   becomes   => k8s.io/api v0.34.2
    sed -i -E "s#=> \./staging/src/(k8s\.io/[A-Za-z0-9._/-]+)#=> \1 $staging#" "$src/go.mod"
    sed -i -E "s#^(\s+k8s\.io/[A-Za-z0-9._/-]+) v0\.0\.0\$#\1 $staging#" "$src/go.mod"
    grep -q '\./staging' "$src/go.mod" && die "k8s.io/kubernetes' go.mod still points into ./staging"
    (cd "$src" && GOFLAGS=-mod=mod "$GO" build -trimpath -ldflags="$flags" \
        -o "$TOOLS_DIR/bin/kube-apiserver.partial" ./cmd/kube-apiserver) || die "building kube-apiserver failed"
    (cd "$src" && GOFLAGS=-mod=mod "$GO" build -trimpath -ldflags="$flags" \
        -o "$TOOLS_DIR/bin/kubectl.partial" ./cmd/kubectl) || die "building kubectl failed"
    install_built kube-apiserver "$want +version"
    install_built kubectl "$want +version"
    rm -rf "$src"
    log "kubernetes: built in $((SECONDS - started))s"
}

# etcd: go.etcd.io/etcd/server/v3's own go.mod has replaces (go install refuses it); a wrapper
# module whose main calls etcdmain.Main resolves the published sibling modules instead.
build_etcd() {
    local want="$ETCD_MODULE@$ETCD_VERSION" src="$TOOLS_DIR/src/etcd-wrapper" started=$SECONDS
    present etcd "$want" && { log "etcd $ETCD_VERSION: present"; return; }
    log "etcd: go build $want through a wrapper module (about 3 min on 2 cores)"
    rm -rf "$src"; mkdir -p "$src"
    cat >"$src/go.mod" <<EOF
module imagebuild.local/etcd

go $GO_MIN_VERSION
EOF
    cat >"$src/main.go" <<'EOF'
// The etcd server's own entry point, built outside its module.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
EOF
    (cd "$src" && "$GO" get "$want" && "$GO" mod tidy \
        && "$GO" build "${GOBUILD[@]}" -o "$TOOLS_DIR/bin/etcd.partial" .) || die "building etcd failed"
    install_built etcd "$want"
    rm -rf "$src"
    log "etcd: built in $((SECONDS - started))s"
}

# Two binaries from one module's tree, CGO off, the version stamped where `--version` reads it
# (MODULE/version.Version): build_two MODULE VERSION NAME ./PKG NAME ./PKG [NOTE].
build_two() {
    local module="$1" version="$2" first="$3" second="$5" note="${7:-}" src started=$SECONDS name pkg
    local want="$module@$version" flags="-s -w -X $module/version.Version=$version"
    if present "$first" "$want" && present "$second" "$want"; then
        log "$first, $second $version: present"; return
    fi
    log "$first, $second: go build $want $4 $6$note"
    src="$(module_tree "$want" "$first-$version")"
    for name in "$first" "$second"; do
        if [ "$name" = "$first" ]; then pkg="$4"; else pkg="$6"; fi
        (cd "$src" && CGO_ENABLED=0 GOFLAGS=-mod=mod "$GO" build -trimpath -ldflags="$flags" \
            -o "$TOOLS_DIR/bin/$name.partial" "$pkg") || die "building $name failed"
    done
    install_built "$first" "$want"
    install_built "$second" "$want"
    rm -rf "$src"
    log "$first, $second: built in $((SECONDS - started))s"
}

# buildkitd and buildctl: BuildKit's go.mod has exclude directives, which `go install` refuses as it
# refuses replaces, so inside its module tree. CGO off: no libseccomp or gcc needed, and the tests
# run it with runc from docker.io (the OCI worker), not containerd.
build_buildkit() {
    build_two "$BUILDKIT_MODULE" "$BUILDKIT_VERSION" buildkitd ./cmd/buildkitd buildctl ./cmd/buildctl \
        " (about 4 min on 2 cores)"
}

# The stargz snapshotter: upstream's daemon and ctr-remote live in a module the Go proxy does not serve
# (github.com/containerd/stargz-snapshotter/cmd), so scripts/stargz/ holds three small mains of ours over
# the published packages; the stamp names a hash of their sources too, so an edit rebuilds them.
STARGZ_TOOLS=(containerd-stargz-grpc:snapshotter stargz-rpull:rpull estargz-verify:verify)
stargz_want() {
    local sources
    sources="$(cd "$SCRIPT_DIR/stargz" && cat ./*/main.go | sha256sum | cut -c1-16)"
    printf '%s@%s+src-%s\n' "$STARGZ_MODULE" "$STARGZ_VERSION" "$sources"
}
build_stargz() {
    local want src="$TOOLS_DIR/src/stargz-wrapper" started=$SECONDS tool name dir ver missing=0
    want="$(stargz_want)"
    for tool in "${STARGZ_TOOLS[@]}"; do present "${tool%%:*}" "$want" || missing=1; done
    [ "$missing" = 0 ] && { log "stargz tools $STARGZ_VERSION: present"; return; }
    ver="$("$GO" env GOVERSION)"
    version_ge "${ver#go}" "$STARGZ_GO_MIN_VERSION" \
        || die "the stargz snapshotter $STARGZ_VERSION needs Go >= $STARGZ_GO_MIN_VERSION, $GO is $ver"
    log "stargz: go build $STARGZ_MODULE@$STARGZ_VERSION through scripts/stargz/ (about 3 min on 2 cores)"
    rm -rf "$src"; mkdir -p "$src"
    cp -r "$SCRIPT_DIR/stargz/." "$src/"
    printf 'module imagebuild.local/stargz\n\ngo %s\n' "$STARGZ_GO_MIN_VERSION" >"$src/go.mod"
    (cd "$src" && "$GO" get "$STARGZ_MODULE@$STARGZ_VERSION" "$STARGZ_MODULE/estargz@$STARGZ_VERSION" \
        && "$GO" mod tidy) || die "resolving the stargz snapshotter's modules failed"
    for tool in "${STARGZ_TOOLS[@]}"; do
        name="${tool%%:*}"; dir="${tool##*:}"
        (cd "$src" && CGO_ENABLED=0 "$GO" build "${GOBUILD[@]}" -o "$TOOLS_DIR/bin/$name.partial" "./$dir") \
            || die "building $name failed"
    done
    for tool in "${STARGZ_TOOLS[@]}"; do install_built "${tool%%:*}" "$want"; done
    rm -rf "$src"
    log "stargz: built in $((SECONDS - started))s"
}

# Kyverno's CLI (cmd/cli/kubectl-kyverno): replace directives again, so inside its module tree. Opt-in
# (IMAGEBUILD_WITH_KYVERNO=1): its build is about twice the tester's, more than CI's budget allows.
build_kyverno() {
    local want="$KYVERNO_MODULE@$KYVERNO_VERSION" src started=$SECONDS
    present kyverno "$want" && { log "kyverno $KYVERNO_VERSION: present"; return; }
    log "kyverno: go build $want/cmd/cli/kubectl-kyverno"
    src="$(module_tree "$want" "kyverno-$KYVERNO_VERSION")"
    (cd "$src" && GOFLAGS=-mod=mod "$GO" build "${GOBUILD[@]}" \
        -o "$TOOLS_DIR/bin/kyverno.partial" ./cmd/cli/kubectl-kyverno) || die "building kyverno's CLI failed"
    install_built kyverno "$want"
    rm -rf "$src"
    log "kyverno: built in $((SECONDS - started))s"
}

# containerd 2.x and its ctr, for the time-to-ready benchmark only: no replace directives, but the
# binaries get names of their own (containerd2, ctr2) so that nothing finds them instead of Debian's.
# CGO off: the btrfs snapshotter is left out; the benchmark's nodes use overlayfs.
build_containerd2() {
    build_two "$CONTAINERD2_MODULE" "$CONTAINERD2_VERSION" containerd2 ./cmd/containerd ctr2 ./cmd/ctr \
        " (about 2 min on 2 cores)"
}

build_all() {
    exec 9>"$LOCK"
    if ! flock -n 9; then
        log "another build of the test tools is running; waiting for it (log: $DETACHED_LOG)"
        flock 9
    fi
    find_go
    build_buildkit
    build_stargz
    build_etcd
    build_policy_tester
    build_kubernetes
    if [ "${IMAGEBUILD_WITH_KYVERNO:-0}" = 1 ]; then build_kyverno; fi
    if [ "${IMAGEBUILD_WITH_CONTAINERD2:-0}" = 1 ]; then build_containerd2; fi
    log "test tools ready: buildkitd, buildctl, stargz tools, policy-tester, etcd, kube-apiserver, kubectl"
}

all_present() {
    local tool want
    want="$(stargz_want)"
    for tool in "${STARGZ_TOOLS[@]}"; do present "${tool%%:*}" "$want" || return 1; done
    present buildkitd "$BUILDKIT_MODULE@$BUILDKIT_VERSION" && present buildctl "$BUILDKIT_MODULE@$BUILDKIT_VERSION" \
        && present etcd "$ETCD_MODULE@$ETCD_VERSION" \
        && present policy-tester "$POLICY_CONTROLLER_MODULE@$POLICY_CONTROLLER_VERSION" \
        && present kube-apiserver "$KUBERNETES_MODULE@$KUBERNETES_VERSION +version" \
        && present kubectl "$KUBERNETES_MODULE@$KUBERNETES_VERSION +version" \
        && { [ "${IMAGEBUILD_WITH_KYVERNO:-0}" != 1 ] || present kyverno "$KYVERNO_MODULE@$KYVERNO_VERSION"; } \
        && { [ "${IMAGEBUILD_WITH_CONTAINERD2:-0}" != 1 ] || { present containerd2 "$CONTAINERD2_MODULE@$CONTAINERD2_VERSION" \
             && present ctr2 "$CONTAINERD2_MODULE@$CONTAINERD2_VERSION"; }; }
}

if [ "${1:-}" = "--check" ]; then
    all_present
    exit
fi
if [ "${1:-}" = "--detach" ]; then
    all_present && { log "present: buildkitd, buildctl, stargz tools, policy-tester, etcd, kube-apiserver, kubectl"; exit 0; }
    # setsid: the build outlives the bootstrap that started it; nice/ionice: it takes only the
    # CPU and disk the main job leaves.
    setsid nice -n 19 ionice -c 3 "$0" </dev/null >>"$DETACHED_LOG" 2>&1 &
    log "building in the background (pid $!, log $DETACHED_LOG)"
    exit 0
fi
build_all
