"""
The project's metadata is in setup.cfg. This file adds one thing: when the
build is asked for it (C{LLMGW_COMPILE=1}), the modules every proxied
request runs through are compiled with mypyc (they are plain, fully typed
Python; compiled, the gateway spends less than half the CPU per request). A
build without it is pure Python and needs no compiler. See
docs/operations.md, "A compiled gateway".

    LLMGW_COMPILE=1 pip install --no-build-isolation '.[compile]'

(C{--no-build-isolation}: mypyc comes with mypy, which the C{compile}
extra installs first; a C compiler and Python's headers are needed.)
"""

import os

from setuptools import setup

#: Compiled when asked: the gateway's hot path, from its front to the
#: upstream client. Nothing else changes with it. (Not llmgw/reactor.py: a
#: compiled subclass of Twisted's reactor would no longer be the shape
#: Twisted's own reactor tests, run against it, rely on.)
# Three rules keep a compiled class native (its attributes C struct fields,
# not dictionary entries; docs/operations.md, "A compiled gateway"):
# - no class decorator mypyc does not know: it compiles such a class as a
#   plain Python class. Interfaces are declared after the class
#   (classImplements), not with @implementer;
# - class-level objects, such as loggers, are ClassVars: a plain class
#   attribute of a native class is an instance default, made anew for each
#   instance (and a Logger is named, since compiled code has no frame for it
#   to find its name from);
# - module constants are Final, read from a C static, not the module's
#   dictionary.
COMPILED = [
    "llmgw/hostcheck.py",
    "llmgw/untrusted.py",
    "llmgw/gateway/adapters.py",
    "llmgw/gateway/admission.py",
    "llmgw/gateway/chunked.py",
    "llmgw/gateway/deadline.py",
    "llmgw/gateway/errors.py",
    "llmgw/gateway/fairqueue.py",
    "llmgw/gateway/forwarding.py",
    "llmgw/gateway/front.py",
    "llmgw/gateway/frontaccept.py",
    "llmgw/gateway/frontflow.py",
    "llmgw/gateway/frontrequest.py",
    "llmgw/gateway/httphead.py",
    "llmgw/gateway/metrics.py",
    "llmgw/gateway/policy.py",
    "llmgw/gateway/prefixindex.py",
    "llmgw/gateway/proxy.py",
    "llmgw/gateway/resource.py",
    "llmgw/gateway/resume.py",
    "llmgw/gateway/router.py",
    "llmgw/gateway/sharing.py",
    "llmgw/transportpeek.py",
    "llmgw/gateway/upstream.py",
    "llmgw/gateway/usage.py",
    "llmgw/gateway/wire.py",
]


def ext_modules() -> list:
    if os.environ.get("LLMGW_COMPILE", "").lower() not in ("1", "yes", "true"):
        return []
    from mypyc.build import mypycify

    return mypycify(COMPILED, opt_level="3")


setup(ext_modules=ext_modules())
