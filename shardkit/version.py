"""The package version, in its own module so that every layer can read it without importing the
package's public face (`shardkit/__init__.py`, which imports the top layers)."""

__version__ = "0.1.0"
