"""The client cache: one HDF5 file per extraction holding every client's labels and frozen-backbone features (all
backbones side by side), with checksums on every array and on the metadata. `write.py` holds the schema and the
writer, `load.py` the reader, `check.py` `verify` and `info`, `migrate.py` the conversion of older formats, and `h5.py`
the HDF5 primitives they share."""

from .check import info, verify
from .h5 import read_attrs, write_attrs
from .load import ClientData, load_clients, open_cache, read_meta
from .migrate import migrate
from .write import FORMAT, Client, Split, cache_path, write

__all__ = ["FORMAT", "open_cache", "read_attrs", "read_meta", "write_attrs", "info", "verify", "Split", "Client",
           "write", "cache_path", "ClientData", "load_clients", "migrate"]
