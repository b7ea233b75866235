"""Optional compiled parts: the codec's short-tuple records (twisternet._smallcodec), the switch dataplane
(innet._fastpath), host I/O (innet._hostio) and the parameter-server packet path (innet._pscore); the rest
is in pyproject.toml.

The extensions need only a C compiler and the Python headers (no third-party build dependencies). When
one cannot be built (no compiler, no headers, a non-Linux libc without recvmmsg), the install still
succeeds: the failure is logged and its Python reference runs instead (the codec's
twisternet.smallrecords, the switch's Python dataplane: innet.fastpath.choose_dataplane, the PS's Python
packet path: innet.pscore.choose_ps_core).
"""

import logging
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

log = logging.getLogger("twisternet.setup")


class OptionalBuildExt(build_ext):
    """build_ext that turns a failed build into a warning: the pure-Python dataplane is the fallback."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - any compiler/toolchain failure means "no extension"
            self._skip(e)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001
            self._skip(e)

    @staticmethod
    def _skip(e: BaseException) -> None:
        msg = ("twisternet: building an optional C extension (twisternet._smallcodec, innet._fastpath, "
               "innet._hostio, innet._pscore) "
               f"failed: {e}; the pure-Python code will be used")
        log.warning(msg)
        sys.stderr.write(f"WARNING: {msg}\n")


# the codec's short-tuple records, both ways (twisternet/smallrecords.py is the reference)
ext_modules = [Extension("twisternet._smallcodec", ["twisternet/_smallcodec.c"], extra_compile_args=["-O2"])]
if sys.platform.startswith("linux"):   # recvmmsg / sendmmsg
    shared = ["innet/_atp_udp.h"]     # what the three share: the ATP header, batched UDP receive and send
    ext_modules.append(Extension("innet._fastpath", ["innet/_fastpath.c"], depends=shared, extra_compile_args=["-O2"]))
    # batched datagram I/O of workers and PS (innet/hostio.py falls back to Python loops without it)
    ext_modules.append(Extension("innet._hostio", ["innet/_hostio.c"], depends=shared, extra_compile_args=["-O2"]))
    # the parameter server's packet path (innet/pscore.py falls back to ParameterServer.handle without it)
    ext_modules.append(Extension("innet._pscore", ["innet/_pscore.c"], depends=shared, extra_compile_args=["-O2"]))

setup(ext_modules=ext_modules, cmdclass={"build_ext": OptionalBuildExt})
