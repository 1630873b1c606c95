# Sourced by the image's scripts: the podman flags this machine needs, in the array
# RHAPSODE_PODMAN_FLAGS (tests/container computes the same in Python).
#
# - runc, where it is installed: Debian's default crun fails on these machines' cgroups
#   ("cgroups in hybrid mode not supported"); runc works wherever podman does.
# - the container's file and process limits set to this shell's own hard limits: podman's
#   defaults are higher than a sandboxed host allows, and raising a limit is refused
#   ("setrlimit RLIMIT_NOFILE: Operation not permitted"); the host's own limits never are,
#   except a process limit above the kernel's pid_max (32768 here), which is refused too.
# RHAPSODE_PODMAN_FLAGS set beforehand (a space-separated string) replaces all of this.
if [ -n "${RHAPSODE_PODMAN_FLAGS:-}" ]; then
    read -r -a RHAPSODE_PODMAN_FLAGS <<< "$RHAPSODE_PODMAN_FLAGS"
else
    RHAPSODE_PODMAN_FLAGS=()
    if command -v runc > /dev/null; then
        RHAPSODE_PODMAN_FLAGS+=(--runtime "$(command -v runc)")
    fi
    nofile=$(ulimit -Hn)
    nproc=$(ulimit -Hu)
    pids=$(cat /proc/sys/kernel/pid_max 2>/dev/null || echo unlimited)
    if [ "$nproc" = unlimited ] || { [ "$pids" != unlimited ] && [ "$nproc" -gt "$pids" ]; }; then
        nproc=$pids
    fi
    [ "$nofile" = unlimited ] || RHAPSODE_PODMAN_FLAGS+=(--ulimit "nofile=$nofile:$nofile")
    [ "$nproc" = unlimited ] || RHAPSODE_PODMAN_FLAGS+=(--ulimit "nproc=$nproc:$nproc")
fi
