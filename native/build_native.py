"""cffi build script for ``horolite._native`` (the kernels in this folder).

setup.py names it in ``cffi_modules``, so ``pip install .`` and
``pip install -e .`` compile it. Run it directly to build in place for
development: ``python native/build_native.py`` compiles under ``build/cffi`` and
copies ``_native*.so`` into ``horolite/``.
"""
import glob
import os
import shutil
import sys
import sysconfig

import cffi

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

CDEF = """
int hl_reduce(void *acc, const void *src, size_t count, int dtype, int op, double postscale);
int hl_scale(void *dst, const void *src, size_t count, int dtype, double factor);
int hl_pack(void *dst, const void *const *srcs, const size_t *nbytes, size_t n, int dtype,
            double factor);
int hl_unpack(void *const *dsts, const void *src, const size_t *nbytes, size_t n);
int hl_isa_get(void);
int hl_isa_set(int level);
const char *hl_isa_name(int level);
#define HL_SHM_STAGED ...
#define HL_SHM_REDUCED ...
#define HL_SHM_GATHERED ...
#define HL_SHM_UNPUBLISHED ...
#define HL_SHM_DIRECT ...
#define HL_SHM_SHARED ...
#define HL_SHM_GATHER ...
#define HL_SHM_ONE_SHOT ...
#define HL_SHM_ONE_SHOT_BYTES ...
int hl_shm_allreduce(int64_t *const *headers, char *const *slots, char *const *arenas,
                     size_t arena_bytes, int n, int r, size_t slot_bytes, int nslots,
                     const char *const *parts, const int64_t *starts, int nparts, void *dst,
                     size_t count, int dtype, size_t itemsize, int op, double postscale,
                     int64_t epoch, int64_t *state, double timeout_s, int polite,
                     int64_t *blocks);
typedef struct { uint32_t set; uint32_t waiters; } hl_wake;
void hl_wake_set(void *wake);
void hl_wake_clear(hl_wake *wake);
int hl_wake_wait(hl_wake *wake, double timeout_s);
size_t hl_board_bytes(int n, int words, size_t mailbox);
hl_wake *hl_board_doorbell(char *board, int n, int words, size_t mailbox, int q);
uint64_t *hl_board_vector(char *board, int n, int words, size_t mailbox, int q, int parity);
char *hl_board_mailbox(char *board, int n, int words, size_t mailbox, int q, int parity);
int64_t hl_board_entered(char *board, int n, int words, size_t mailbox, int q);
#define HL_BOARD_RING_NONE ...
#define HL_BOARD_RING_BUSY ...
#define HL_BOARD_RING_ALL ...
int hl_board_enter(char *board, int n, int words, size_t mailbox, int r, int64_t round,
                   int ring);
void hl_board_set_busy(char *board, int n, int words, size_t mailbox, int r, int on);
int hl_board_wait(char *board, int n, int words, size_t mailbox, int64_t round,
                  double timeout_s, double spin_s);
void hl_board_or(char *board, int n, int words, size_t mailbox, int64_t round, uint64_t *out);
#define HL_BOARD_ENOTCARRIED ...
int hl_board_reduce_carried(char *board, int n, int words, size_t mailbox, int64_t round,
                            int64_t slot, void *out, size_t nbytes, size_t count, int dtype,
                            int op, double postscale);
"""


if sys.platform == "win32":
    _CFLAGS = ["/O2"]
else:
    # -O3 vectorizes the loops. No -march: kernels.c compiles an x86-64-v3
    # variant itself and picks it at run time. -ffp-contract=off keeps
    # a*b+c from fusing, so every level rounds like NumPy;
    # -fno-trapping-math lets GCC if-convert the branch-free float16 code
    # (we never read floating-point exception flags).
    _CFLAGS = ["-O3", "-ffp-contract=off", "-fno-trapping-math"]


def make_builder(relative):
    """The FFI for horolite._native; source paths relative to the project
    root (what setuptools wants: pip runs setup.py there) or absolute."""
    def path(*names):
        full = os.path.join(HERE, *names)
        return os.path.relpath(full, REPO) if relative else full

    builder = cffi.FFI()
    builder.cdef(CDEF)
    builder.set_source(
        "horolite._native",
        '#include "kernels.h"\n#include "shm_ring.h"\n#include "wake.h"\n#include "shm_board.h"',
        sources=[path("kernels.c"), path("shm_ring.c"), path("wake.c"), path("shm_board.c")],
        include_dirs=[path()],
        depends=[path("kernels.h"), path("kernels_impl.h"), path("shm_ring.h"), path("wake.h"), path("relax.h"),
                 path("shm_board.h")],
        extra_compile_args=_CFLAGS,
    )
    return builder


ffibuilder = make_builder(relative=os.path.abspath(os.getcwd()) == REPO)


def _in_place_name(built):
    # pip/setuptools name the module _native.abi3.so, cffi building against
    # the limited API (not on debug or free-threaded Pythons); take the same
    # name so the two kinds of build replace each other instead of the one
    # with the preferred suffix (.cpython-3XX-...) silently shadowing the other.
    limited = not hasattr(sys, "gettotalrefcount") and not sysconfig.get_config_var(
        "Py_GIL_DISABLED")
    if limited and built.endswith(".so"):
        return "_native.abi3.so"
    return os.path.basename(built)


def build_in_place():
    """Compile under build/cffi and copy the module into horolite/, removing
    other builds of it there (they could shadow this one)."""
    tmpdir = os.path.join(REPO, "build", "cffi")
    built = make_builder(relative=False).compile(tmpdir=tmpdir, verbose=True)
    package = os.path.join(REPO, "horolite")
    for stale in glob.glob(os.path.join(package, "_native.*")):
        if stale.endswith((".so", ".pyd")):
            os.remove(stale)
    target = os.path.join(package, _in_place_name(built))
    shutil.copyfile(built, target)
    print(f"copied {os.path.relpath(built, REPO)} -> {os.path.relpath(target, REPO)}")
    return target


if __name__ == "__main__":
    build_in_place()
