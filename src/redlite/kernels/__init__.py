"""Our own small native (C) kernels, built on first use (see :mod:`redlite.kernels.native`)."""
