"""The conversation state file, in four modules with one job each, re-exported here:

* :mod:`redlite.core.session_format`: layout, constants, header parsing, compatibility;
* :mod:`redlite.core.session_hash`: the checksum (XXH3-64; CRC-32 for older files);
* :mod:`redlite.core.session_write`: atomic writing (:func:`write_state_file`);
* :mod:`redlite.core.session_read`: mapping, verifying and filling (:func:`open_state_file`,
  :func:`read_state_file`, :func:`read_meta`, :class:`StateFile`).
"""

from redlite.core.session_format import (FORMAT, MAX_HEADER_BYTES, READ_VERSIONS, VERSION,
                                         WRITE_CHUNK, Expected, SessionFileError, _canonical,
                                         _parse_header, canonical_header, check_compatible,
                                         parse_header)
from redlite.core.session_hash import Hasher, HashWorker, _checksum, _Hasher, _HashWorker, checksum_of
from redlite.core.session_read import (StateFile, open_state_file, read_meta, read_state_file)
from redlite.core.session_write import _fsync_dir, write_state_file

__all__ = ["FORMAT", "MAX_HEADER_BYTES", "READ_VERSIONS", "VERSION", "WRITE_CHUNK", "Expected",
           "HashWorker", "Hasher", "SessionFileError", "StateFile", "canonical_header",
           "check_compatible", "checksum_of", "open_state_file", "parse_header", "read_meta",
           "read_state_file", "write_state_file", "_canonical", "_checksum", "_fsync_dir",
           "_Hasher", "_HashWorker", "_parse_header"]
