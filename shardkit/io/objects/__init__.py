"""Object storage (s3://): the S3 backend, mirrors that read a prefix as local sparse files
(fetching only what an operation plans), uploads that commit as the output transaction does
(their sink sends finished files while a save still writes), and the records of published outputs.

Above it, no package imports these modules directly except through the seams docs/ARCHITECTURE.md
lists; every writer still stages through `safety`.
"""
