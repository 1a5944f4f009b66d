"""Checkpoints, datasets and outputs kept safe: nothing a run writes is lost, nothing it reads runs code.

Read in this order.

**Writing a checkpoint.** Each small file is replaced whole (`atomic`: a sibling written, fsynced,
renamed over), so a crash leaves the old content or the new. A checkpoint directory's last file is
its `manifest.json` (`manifest`: every file's size and xxh3-128 hash); a directory without one, or
whose files do not match it, is not a checkpoint, and rotation removes an older checkpoint only
after a newer one verifies. One process writes each output (`data_prep.lock`: `run.dir/trainer.lock`,
each prep node's lock), so two trainers never interleave on one directory. Metrics are JSON lines a
crash cannot corrupt for good (`jsonl`). Native checkpoints (`native`) are safetensors, which hold
no code, with the model's config and a manifest.

**Reading a checkpoint.** A `.pt` file is a pickle in a zip archive. Before torch opens it, the
archive must be one plain zip that every reader sees alike (`plain_zip`), its hash the manifest's;
then it is loaded by torch's restricted unpickler with an allow-list of the types training writes
(`safe_load`). `checkpoints` builds on these to find a run's checkpoints, load a model from any of
them (ZeRO 0-3, universal, native) and read the optimiser's state. A reader beside a live run holds
a lease (`leases`) so that rotation never deletes what it is reading.

**Reading a dataset.** The prep's MDS datasets are opened through `mds_datasets`: each index
checked before Streaming reads it (`data_prep.mds_index`: shard files that stay in the dataset's
directory, sizes that match), and the node's shared memory registered under a lock, so that jobs
starting together never take the same prefix.

**Who writes where** (`data_prep.outputs`, below every command that writes): a command writes only
into a new or empty directory, or resumes its own kind of output, known by the files only that kind
writes; new outputs are filled under a temporary name and renamed into place.

`plain_zip` serves `safe_load` alone but stays a module of its own: it is a zip parser with its
own story (which readers disagree about which layouts), and the allow-list reads better without it.
"""
