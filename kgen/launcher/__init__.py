"""The host side of every generated module, written once: argument checks, ``can_handle`` /
``why_not``, launch set-up, the launch rules, scratch caching, PDL and both call shapes.

A generated module (``generated/<uri>.py``) holds only what is specialized: its
``@triton.jit`` / ``@gluon.jit`` kernels, their constants and one declaration of what it is
(``ModuleIdentity``). It builds a ``VerifyLauncher`` (``InvariantVerifyLauncher`` for the
batch-invariant variant) from them and binds its entry points as module names.

This package imports only torch, triton and its own files (relative imports), so an engine
that vendors kernels copies a generated module plus this folder. Nothing is imported here:
``kgen.launcher.switches`` and ``kgen.launcher.rules`` stay standard-library only for kgen's
command line.
"""
