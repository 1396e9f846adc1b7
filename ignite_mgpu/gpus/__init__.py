"""The machine's GPUs and who has them, torch-free (imports nothing here):

- ``inventory``: GPU discovery (NVML, nvidia-smi) and each GPU's NUMA node, links, P2P and PCIe link, as a snapshot;
- ``links``: how the GPUs are linked (``nvidia-smi topo -m``, NVML), ranked, and the best-linked set of candidates;
- ``pcie``: P2P between each pair (``nvidia-smi topo -p2p r``, NVML) and each GPU's PCIe link, narrowed or not;
- ``ranges``: ``--gpus auto:MIN-MAX``, an elastic job's range, and how many GPUs it takes from a snapshot;
- ``selection``: the ``--gpus`` grammar and the physical ids a job uses, pure over the snapshot;
- ``choice``: ``--gpus auto``'s choice: the idlest GPUs, the best linked among equals, and the line saying why;
- ``claims``: GPU claims on a shared machine (flocks in one machine-wide folder), taken and let go;
- ``holders``: who holds each claim, read from the folder without trusting it;
- ``waiting``: the line of jobs waiting for GPUs (``--wait``), a ticket each;
- ``lending``: what an elastic job lends to the waiting line, or takes back when nobody waits (pure);
- ``health``: which of a job's GPUs failed (gone, reported lost, named by a rank's device error);
- ``shared_dir``: safe reading and writing of files in a folder that several users write;
- ``acquire``: ``--gpus`` planned around the claims, claimed all-or-nothing; ``--wait`` in line;
- ``devices``: the ``ignite-mgpu devices`` table.
"""
