"""The I/O core: every byte shardkit writes or deletes, and every small file it reads, goes
through this package.

- `safety/`: the output transaction (staging beside the destination, overlap checks by device
  and inode, the folder lock, Ctrl-C/SIGTERM and stale cleanup, commit by rename or by a marker
  written last; the sink an output hands its writers), safe deletion, the bounded small-file reader and the one translation of OS errors
  into one-line messages;
- `data/`: hashing files, direct I/O, kernel copies, buffers, positional reads and the read taps
  the check on read hashes;
- `objects/`: object storage (S3 mirrors, uploads and their sinks, published outputs);
- `location.py`: the one parser of every location a user gives (a path or s3://); `records.py`:
  whose a folder is (the trainer's run record, local or in object storage).

It sits below formats/, checkpoint/ and engine/, so all of them share it; it imports only the
foundation (errors, paths, sizes, distributed).
"""
