"""The client cache: one HDF5 file per extraction holding every client's labels and frozen-backbone features (all
backbones side by side), with checksums on every array and on the metadata. `write.py` holds the writer, `open.py`
opens a cache read-only, `load.py` the reader, `check.py` `verify` and `info`, `migrate.py` the conversion of older
formats, `identity.py` the content keys of caches and stores, and `h5.py` the HDF5 primitives they share.

Schema (format 4; every attribute that is not a number or string is a JSON string):

    /                                   attrs: featcache_format, featcache_version, key, manifest (JSON: everything
                                               that determines the embeddings), backbones (JSON list = column order),
                                               classes, domains, dataset, partition, counts (each client's domain and
                                               rows by split), views, versions, images, meta_sha256
    /backbones/<bkey>                   attrs: name, weights, weights_sha256, dim, columns ([start, stop) of its
                                               features in `concat`), preprocessing (JSON)
    /<split>/offsets                    [C + 1] int64       client c's rows are rows offsets[c]:offsets[c + 1] of
                                                            every dataset of the split; split is 'train' or 'test'
    /<split>/labels                     [N] int64           every client's rows, client after client
    /<split>/source_index               [N] int64           index into the dataset's domain split
    /<split>/domain                     [N] int16           index into root attr `domains`
    /<split>/features/concat            [N, sum D_b] float32  every backbone's features side by side
    /train/views/concat                 [N, V, sum D_b] float32  only with --views V (augmented training views)
    /train/val_index                    [v] int64           each client's validation positions (inside its own
                                                            train rows), client after client
    /train/val_offsets                  [C + 1] int64       client c's are val_index[val_offsets[c]:val_offsets[c + 1]]

A cache holds the same 20 or so HDF5 objects whatever its number of clients: what opening, checking and reading one
costs does not grow with the clients (a group per client, formats 2 and 3, made the per-object work most of a first
load of 1,000 clients; `featcache migrate` converts them). The features exist once, as `concat`; backbone b is its
columns `columns` (`x[..., start:stop]`), so reading all backbones, what training does by default, is one
contiguous read of a split.

Every dataset carries `sha256`, the sha256 of its array bytes (C order), computed by the writer from the bytes it
writes, and the root `meta_sha256` covers the rest: every object's path, kind, dtype, shape and attributes (`h5`).
`check.verify` recomputes both and checks the schema; `load.load_clients` checks the same on a file's first load.

The root attribute `featcache_format` is featcache's mark on a cache (`write.MARKER`): `featcache migrate` converts
only files that carry it, and `featcache gc` never removes a cache.
"""

from .check import info, verify
from .h5 import read_attrs, write_attrs
from .load import ClientData, client_rows, columns, load_clients
from .migrate import migrate
from .open import open_cache, read_meta
from .write import FORMAT, Client, Split, cache_path, write

__all__ = [
    "FORMAT",
    "open_cache",
    "read_attrs",
    "read_meta",
    "write_attrs",
    "info",
    "verify",
    "Split",
    "Client",
    "write",
    "cache_path",
    "ClientData",
    "load_clients",
    "columns",
    "client_rows",
    "migrate",
]
