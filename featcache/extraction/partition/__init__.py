"""Split a `Dataset` among federated clients: which train, test and validation images each client owns.

Only labels are read. A `PartitionSpec` (plain data, saved with every cache and result; spec.py) names a scheme
(schemes.py) that decides each client's training images; steps shared by every scheme follow (steps.py), and
`make_partition` (make.py) runs them in order.

Schemes (Tan et al., FedPCL, NeurIPS 2022, App. A.1, Tables 8-10 and 12-13):

* feature: client i owns domain i mod #domains; each domain's class pools are split evenly among its clients and
  capped at `per_class` images per class per client (FedPCL feature shift: 10 per class, 200 test per class).
* label: one domain; for every class, Dirichlet(alpha) proportions over the clients (Hsu et al. 2019) with the
  balancing rule of FedPCL's and NIID-Bench's code (a client already holding N/clients images gets no more).
  `per_class` first cuts each class pool to per_class * clients images (FedPCL's label shift keeps a small pool).
* feature-label: client i owns domain i mod #domains; for every class k, proportions p_k ~ Dir(alpha) over all
  clients and client i asks for floor(p_ik * clients * per_class) images of class k from its own domain, as
  FedPCL's official code does (Table 10: sizes [100, 75, 112, 120, 65]); without `per_class`, its even share of
  the class pool. A domain's clients draw disjoint images; requests beyond the pool shrink in proportion.
* pathological: one domain; each client holds exactly `classes_per_client` distinct classes (McMahan et al. 2017's
  shards) and every class is shared evenly among its holders.
* iid: one domain; a stratified, even random split.

Dirichlet draws that leave a client without training images are redrawn (bounded); impossible requests raise
`UserError`. `order` says which images of a class pool come first: "shuffled" (seeded, the default) or "first"
(the dataset's own order, as FedPCL's code takes the first 10 train and 200 test images per class).

Shared steps:

* test (`test_split`, spec.TEST_SPLITS): "whole", the feature scheme's default, shares each domain's whole test
  split evenly among its clients (FedBN's and FedPCL's protocol); "train-mix", the other schemes' default, gives a
  client test images with its training label distribution, as many as the domain's test pools allow. Both are
  capped by `test_per_class` and disjoint from the other clients of the domain. With `holdout_domain`
  (leave-one-domain-out, multi-domain schemes) clients train on the other domains and every client is tested on
  all of the held-out one, its train and test splits.
* percent (FedBN's `--percent`): clients draw only from a prefix of each domain's train split (`steps._kept_train`).
* val: positions into the client's train array, stratified by label and seeded; a class keeps at least one image in
  train. Validation picks hyperparameters; the final run trains on the whole train array again (FedPCL, App. A.1.4).
* indices are sorted ascending (HDF5 reads with increasing indices).

Randomness: everything is deterministic given `seed`, and every step draws from a stream of its own, seeded by `seed`
and the step's name alone (`steps._stream`): "pools/train/<domain>" and "pools/test/<domain>" shuffle a domain's
class pools, "split" makes the scheme's draws (Dirichlet proportions, the pathological deck), "val/<client>" picks a
client's validation positions. A draw added to or removed from one step changes no other step's draws, a domain
added changes no other domain's pools, a client added no other client's validation positions.
"""

from .make import ClientPart, make_partition, partition_counts
from .schemes import list_schemes
from .spec import PartitionSpec

__all__ = ["ClientPart", "PartitionSpec", "list_schemes", "make_partition", "partition_counts"]
