"""Filesystem safety: how every output comes into being and goes away.

The output transaction (staging beside the destination, overlap checks by device and inode, the
folder lock, Ctrl-C/SIGTERM and stale cleanup, commit by rename or by a marker written last), safe
deletion, durable small writes, the bounded small-file reader and the one
translation of OS errors into one-line messages. Imports nothing of `data`.
"""
