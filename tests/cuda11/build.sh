#!/usr/bin/env bash
# make cuda11: CUDA 11.8's runtime (libcudart11.0) and headers (nvidia-cuda-dev's /usr/include) from
# Debian bookworm's non-free component, through a private apt source list under $BUILD/cuda11/apt
# (the system's /etc/apt is neither read for sources nor changed), then tests/cuda11/cuda11_prog.c
# built against them: $BUILD/cuda11/cuda11_prog, with libcudart.so.11.0 beside it (RUNPATH $ORIGIN),
# for tests/gpu/cuda11.sh on a GPU machine.  Downloads happen once; nvidia-cuda-dev is 774 MB.
set -eu
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
CC=${CC:-cc}
out="$PWD/$BUILD/cuda11"
apt="$out/apt"
mkdir -p "$apt/lists/partial" "$apt/archives/partial" "$out/root"
if [ ! -f "$out/root/usr/include/cuda_runtime_api.h" ] || [ ! -e "$out/root/usr/lib/x86_64-linux-gnu/libcudart.so.11.0" ]; then
  echo 'deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main contrib non-free' > "$apt/sources.list"
  O=(-o "Dir::Etc::SourceList=$apt/sources.list" -o Dir::Etc::SourceParts=/dev/null -o "Dir::State::Lists=$apt/lists"
     -o "Dir::Cache::Archives=$apt/archives" -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache= -o Debug::NoLocking=1)
  [ "$(id -u)" = 0 ] && O+=(-o APT::Sandbox::User=root)
  echo "cuda11: fetching libcudart11.0 and nvidia-cuda-dev (Debian bookworm non-free; 775 MB)"
  apt-get "${O[@]}" update -qq
  (cd "$apt" && apt-get "${O[@]}" download -qq libcudart11.0 nvidia-cuda-dev)
  dpkg-deb -x "$apt"/libcudart11.0_*.deb "$out/root"
  dpkg-deb --fsys-tarfile "$apt"/nvidia-cuda-dev_*.deb | tar -xf - -C "$out/root" --wildcards './usr/include/*'
  rm -f "$apt"/*.deb
fi
rm -f "$out"/libcudart.so.11*
cp -L "$out/root/usr/lib/x86_64-linux-gnu/libcudart.so.11.0" "$out/"
grep -q 'define CUDART_VERSION  *11080' "$out/root/usr/include/cuda_runtime_api.h"
"$CC" -std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -O2 -I"$out/root/usr/include" tests/cuda11/cuda11_prog.c \
  -o "$out/cuda11_prog" "$out/libcudart.so.11.0" -Wl,-rpath,'$ORIGIN'
echo "cuda11: built $BUILD/cuda11/cuda11_prog (CUDA 11.8 headers, NEEDED libcudart.so.11.0, RUNPATH \$ORIGIN)"
