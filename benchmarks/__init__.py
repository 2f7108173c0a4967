"""gradzip's benchmark scripts, one module each; ``benchmarks/README.md`` indexes them.

Run a script as a module from the repository root, ``python -m benchmarks.NAME [options]``,
so that the scripts import each other (and ``benchmarks._common``) as a package.
"""
