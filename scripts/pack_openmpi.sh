#!/usr/bin/env bash
# Packs this machine's Open MPI runtime (Debian's openmpi-bin: mpirun, orted, the MCA and PMIx
# plugins, their help texts, and the libraries they need beyond the C runtime) into DEST, to be
# run where Open MPI is not installed (the GPU machine: scripts/gpu_pack.sh). There:
#   export OPAL_PREFIX=DEST PMIX_INSTALL_PREFIX=DEST/pmix2 PATH=DEST/bin:$PATH LD_LIBRARY_PATH=DEST/lib:$LD_LIBRARY_PATH
# (Open MPI and PMIx find their plugins under those prefixes: Debian installs them under the
# configured prefix /usr, which OPAL_PREFIX replaces.)
#
#   scripts/pack_openmpi.sh DEST            DEST is created; about 15 MB
#   scripts/pack_openmpi.sh --check DEST    runs a 2-rank job with DEST's runtime while this
#                                            machine's Open MPI is hidden (root: a mount namespace)
set -euo pipefail
check=0
[ "${1:-}" = "--check" ] && { check=1; shift; }
dest=${1:?usage: pack_openmpi.sh [--check] DEST}
ml=/usr/lib/x86_64-linux-gnu

if [ "$check" = 1 ]; then
  # Hide the installed runtime (its plugins, help texts, launchers and libraries), then run
  # mpirun from DEST: `hostname` on two ranks, and a program linked against libmpi.
  prog=${2:-}
  hide() { for p in "$@"; do [ -e "$p" ] || continue; if [ -d "$p" ]; then mount -t tmpfs none "$p"; else mount --bind /dev/null "$p"; fi; done; }
  export -f hide
  exec unshare -m bash -c "
    set -e
    hide $ml/openmpi $ml/pmix2 /usr/share/openmpi /etc/openmpi /usr/bin/orterun /usr/bin/orted \
         \$(ls $ml/libmpi.so.* $ml/libopen-rte.so.* $ml/libopen-pal.so.* $ml/libpmix.so.* 2>/dev/null)
    export OPAL_PREFIX=$dest PMIX_INSTALL_PREFIX=$dest/pmix2 PATH=$dest/bin:\$PATH LD_LIBRARY_PATH=$dest/lib:\${LD_LIBRARY_PATH:-}
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    mpirun -np 2 --oversubscribe --bind-to none hostname
    if [ -n '$prog' ]; then mpirun -np 2 --oversubscribe --bind-to none $prog; fi"
fi

command -v orterun >/dev/null || { echo "pack_openmpi.sh: no Open MPI here (apt-get install openmpi-bin)" >&2; exit 2; }
rm -rf "$dest" && mkdir -p "$dest/bin" "$dest/lib" "$dest/lib/x86_64-linux-gnu/openmpi/lib" "$dest/share" "$dest/pmix2/lib"
cp -L "$(command -v orterun)" "$dest/bin/mpirun"
cp -L "$(command -v orted)" "$dest/bin/orted"
cp -rL "$ml/openmpi/lib/openmpi3" "$dest/lib/x86_64-linux-gnu/openmpi/lib/"
cp -L "$ml"/openmpi/lib/libmca_common_*.so.* "$dest/lib/" 2>/dev/null || true
cp -rL /usr/share/openmpi "$dest/share/"
cp -rL "$ml/pmix2/lib/pmix" "$dest/pmix2/lib/"
[ -d "$ml/pmix2/share" ] && cp -rL "$ml/pmix2/share" "$dest/pmix2/"
# The libraries all of these load, but not the C runtime and not CUDA's (the GPU machine has its own).
{
  ldd "$dest/bin/mpirun" "$dest/bin/orted" "$dest"/lib/x86_64-linux-gnu/openmpi/lib/openmpi3/*.so "$dest"/pmix2/lib/pmix/*.so 2>/dev/null |
    awk '/=> \// {print $3}'
} | grep -Ev 'libc\.so|libm\.so|libgcc_s|libstdc\+\+|ld-linux|libpthread|libdl\.|librt\.|cuda|nvidia' | sort -u |
  while read -r lib; do cp -L "$lib" "$dest/lib/"; done
strip "$dest/bin/"* 2>/dev/null || true
du -sh "$dest"
