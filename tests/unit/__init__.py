"""The unit tests, one folder per wing of the code (``buffers/`` tests ``melissa_dl/buffers/``, ``launcher/`` the
``launcher`` package, ``examples/`` the examples' code); a test of a module at the top of ``melissa_dl`` (``config``,
``cli``, ``supervisor``, ``reference``) or of the whole repository (its layout, its docs, its public API) stays here.

Packages, so that pytest imports them as ``unit.<wing>.test_...``: two wings may hold test files of the same name,
and a folder of plain test files on ``sys.path`` would shadow the real package it is named after (``launcher``)."""
