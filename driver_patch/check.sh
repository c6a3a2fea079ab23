#!/usr/bin/env bash
# Applies the driver_patch/ series to a copy of NVIDIA's open-gpu-kernel-modules
# and compiles the nvidia-uvm module against a kernel header tree.
#
#   SRC_DIR=/path/to/open-gpu-kernel-modules driver_patch/check.sh
#
# SRC_DIR         a checkout of the tag the series is made for (580.142); it is
#                 copied, never modified.
# KERNEL_HEADERS  kernel build tree (default /lib/modules/$(uname -r)/build),
#                 e.g. /usr/src/linux-headers-6.1.0-56-amd64 on Debian 12.
# KERNEL_SOURCES  its source tree when it is a separate one (default: found
#                 from KERNEL_HEADERS: its source link, or the tree its
#                 Makefile includes, as on Debian).
# WORK_DIR        where the patched copy is built (default: a temporary
#                 directory, removed on success). Emptied first.
# JOBS            parallel compile jobs (default: nproc).
#
# Steps, each fatal on failure: the series' copy of vattn_uvm_ioctl.h equals
# csrc/backends/vattn_uvm_ioctl.h; the header compiles as C11 and C++11 (its
# size and offset asserts); uvm_stock_ioctl.h (the stock ioctls the backend
# declares by hand) agrees with the module's uvm_ioctl.h; every patch applies
# with no fuzz; nvidia-uvm.ko compiles (only nvidia-uvm: the nvidia module's
# conftests are included, its binary core is not needed); every symbol
# nvidia-uvm.ko leaves undefined is exported by the kernel (Module.symvers) or
# by the nvidia module's sources, which is what loading it next to nvidia.ko
# resolves. A module that passes this was compiled and linked, never loaded:
# see README.md.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
# The ABI headers live with the backend that includes them; this folder holds the patches.
ABI_DIR=$(cd "$HERE/../csrc/backends" && pwd)
EXPECTED_TAG=580.142

fail() { echo "check.sh: FAIL: $*" >&2; exit 1; }
step() { echo "==> $*"; }

[ -n "${SRC_DIR:-}" ] || fail "set SRC_DIR to an open-gpu-kernel-modules checkout (tag $EXPECTED_TAG)"
[ -d "$SRC_DIR/kernel-open/nvidia-uvm" ] || fail "$SRC_DIR has no kernel-open/nvidia-uvm: not open-gpu-kernel-modules"
for tool in patch make nm "${CC:-cc}"; do
  command -v "$tool" >/dev/null || fail "$tool is not installed"
done

version=$(sed -n 's/^NVIDIA_VERSION *= *//p' "$SRC_DIR/version.mk" 2>/dev/null || true)
step "source: $SRC_DIR (NVIDIA_VERSION ${version:-unknown})"
[ "$version" = "$EXPECTED_TAG" ] || echo "warning: the series is made for $EXPECTED_TAG, this tree is ${version:-unknown}"

KERNEL_HEADERS=${KERNEL_HEADERS:-/lib/modules/$(uname -r)/build}
[ -f "$KERNEL_HEADERS/Makefile" ] ||
  fail "no kernel build tree at $KERNEL_HEADERS: install the headers of the running kernel or set KERNEL_HEADERS (Debian: apt-get install linux-headers-amd64)"
KERNEL_HEADERS=$(cd "$KERNEL_HEADERS" && pwd -P)
if [ -z "${KERNEL_SOURCES:-}" ]; then
  if [ -d "$KERNEL_HEADERS/source" ]; then
    KERNEL_SOURCES=$(cd "$KERNEL_HEADERS/source" && pwd -P)
  elif included=$(sed -n 's/^include \(.*\)\/Makefile$/\1/p' "$KERNEL_HEADERS/Makefile") && [ -n "$included" ] && [ -d "$included" ]; then
    KERNEL_SOURCES=$included  # Debian: linux-headers-<ver>-<flavour> includes linux-headers-<ver>-common
  else
    KERNEL_SOURCES=$KERNEL_HEADERS
  fi
fi
[ -f "$KERNEL_HEADERS/Module.symvers" ] || fail "$KERNEL_HEADERS has no Module.symvers (needed for the link check)"
kernel_version=$(make -s -C "$KERNEL_HEADERS" kernelversion 2>/dev/null | tail -1 || true)
step "kernel headers: $KERNEL_HEADERS (sources $KERNEL_SOURCES, Linux ${kernel_version:-unknown})"

# ---- the ABI header --------------------------------------------------------

step "vattn_uvm_ioctl.h: the series carries csrc/backends/vattn_uvm_ioctl.h verbatim"
header_patch=$(ls "$HERE"/0001-*.patch)
awk '/^\+\+\+ /{on=1; next} on && /^\+/{print substr($0, 2)} on && /^-- $/{exit}' "$header_patch" |
  cmp -s - "$ABI_DIR/vattn_uvm_ioctl.h" || fail "$header_patch does not add csrc/backends/vattn_uvm_ioctl.h verbatim"

step "vattn_uvm_ioctl.h compiles as C11 and C++11 (size and offset asserts)"
tmp_hdr=$(mktemp -d)
printf '#include "vattn_uvm_ioctl.h"\nint main(void) { return VATTN_UVM_QUERY == 0; }\n' > "$tmp_hdr/t.c"
cp "$tmp_hdr/t.c" "$tmp_hdr/t.cpp"
"${CC:-cc}" -std=c11 -Wall -Wextra -Werror -pedantic -I"$ABI_DIR" -c "$tmp_hdr/t.c" -o "$tmp_hdr/t.o" || fail "header does not compile as C11"
"${CXX:-c++}" -std=c++11 -Wall -Wextra -Werror -pedantic -I"$ABI_DIR" -c "$tmp_hdr/t.cpp" -o "$tmp_hdr/t.o" || fail "header does not compile as C++11"

step "uvm_stock_ioctl.h matches the module's own stock ioctl numbers and layouts"
"${CC:-cc}" -std=gnu11 -Wall -Werror -I"$SRC_DIR/kernel-open/nvidia-uvm" -I"$SRC_DIR/kernel-open/common/inc" -I"$ABI_DIR" \
  -c "$HERE/stock_abi_check.c" -o "$tmp_hdr/stock.o" || fail "uvm_stock_ioctl.h disagrees with $SRC_DIR's uvm_ioctl.h"
rm -rf "$tmp_hdr"

# ---- apply -----------------------------------------------------------------

if [ -n "${WORK_DIR:-}" ]; then
  mkdir -p "$WORK_DIR"
  WORK_DIR=$(cd "$WORK_DIR" && pwd -P)
  remove_work=0
else
  WORK_DIR=$(mktemp -d)
  remove_work=1
fi
tree="$WORK_DIR/open-gpu-kernel-modules"
rm -rf "$tree"
mkdir -p "$tree"
cp -a "$SRC_DIR/kernel-open" "$tree/"
[ -f "$SRC_DIR/version.mk" ] && cp "$SRC_DIR/version.mk" "$tree/"

patches=$(ls "$HERE"/[0-9]*.patch | sort)
for p in $patches; do
  step "apply $(basename "$p")"
  out=$(patch -p1 --forward --fuzz=0 --no-backup-if-mismatch -d "$tree" < "$p" 2>&1) || { echo "$out"; fail "$(basename "$p") does not apply to $SRC_DIR"; }
  echo "$out" | sed 's/^/    /'
  if grep -q "offset" <<<"$out"; then echo "    (applied at an offset: the tree is not exactly $EXPECTED_TAG)"; fi
done

# ---- build -----------------------------------------------------------------

arch=$(uname -m | sed -e 's/aarch64/arm64/')
step "compile nvidia-uvm.ko (make -j${JOBS:-$(nproc)}; a few minutes)"
log="$WORK_DIR/build.log"
set +e
make -C "$KERNEL_HEADERS" M="$tree/kernel-open" ARCH="$arch" ${CC:+CC="$CC"} \
  NV_KERNEL_SOURCES="$KERNEL_SOURCES" NV_KERNEL_OUTPUT="$KERNEL_HEADERS" \
  NV_KERNEL_MODULES="nvidia nvidia-uvm" NV_SPECTRE_V2=0 KBUILD_MODPOST_WARN=1 \
  -j"${JOBS:-$(nproc)}" nvidia-uvm.ko > "$log" 2>&1
rc=$?
set -e
ko="$tree/kernel-open/nvidia-uvm.ko"
if [ $rc -ne 0 ] || [ ! -f "$ko" ]; then
  grep -E "error|Error" "$log" | head -40 || true
  tail -20 "$log"
  fail "nvidia-uvm.ko did not compile (log: $log)"
fi
# Warnings in the files the series adds are failures too.
if grep -E "nvidia-uvm/(uvm_vattn\.[ch]|vattn_uvm_ioctl\.h).*warning" "$log"; then
  fail "the series' own files compile with warnings (log: $log)"
fi
for obj in uvm_vattn uvm_map_external uvm_va_space uvm; do
  [ -f "$tree/kernel-open/nvidia-uvm/$obj.o" ] || fail "nvidia-uvm/$obj.o was not built"
done
# (nm's output goes to a file: grep -q in a pipe would stop reading early and,
# under pipefail, fail the check through nm's SIGPIPE)
nm "$tree/kernel-open/nvidia-uvm/uvm.o" > "$WORK_DIR/uvm_o_symbols.txt"
for call in query create map unmap release; do
  grep -q " U uvm_api_vattn_$call\$" "$WORK_DIR/uvm_o_symbols.txt" || fail "uvm.o does not route the VATTN_UVM_ ioctl $call"
done

step "link check: every undefined symbol is exported by the kernel or by nvidia.ko"
nm -u "$ko" | awk '{print $2}' | sort -u > "$WORK_DIR/undefined.txt"
awk '{print $2}' "$KERNEL_HEADERS/Module.symvers" | sort -u > "$WORK_DIR/kernel_exports.txt"
grep -rhoE "EXPORT_SYMBOL(_GPL)?\(\s*\w+\s*\)" "$tree/kernel-open/nvidia" "$tree/kernel-open/common" |
  sed -E 's/.*\(\s*(\w+)\s*\)/\1/' | sort -u > "$WORK_DIR/nvidia_exports.txt"
comm -23 "$WORK_DIR/undefined.txt" "$WORK_DIR/kernel_exports.txt" | comm -23 - "$WORK_DIR/nvidia_exports.txt" > "$WORK_DIR/unresolved.txt"
if [ -s "$WORK_DIR/unresolved.txt" ]; then
  cat "$WORK_DIR/unresolved.txt"
  fail "nvidia-uvm.ko needs symbols nobody exports"
fi
echo "    $(wc -l < "$WORK_DIR/undefined.txt") undefined symbols: $(comm -23 "$WORK_DIR/undefined.txt" "$WORK_DIR/kernel_exports.txt" | wc -l) from nvidia.ko, the rest from the kernel"

size=$(stat -c %s "$ko")
step "OK: $(basename "$ko") built for Linux ${kernel_version:-?} from ${version:-?} + $(echo "$patches" | wc -w) patches ($size bytes)"
echo "    compile-checked only: this module was not loaded on a GPU"
if [ "$remove_work" = 1 ]; then rm -rf "$WORK_DIR"; else echo "    build tree: $tree"; fi
