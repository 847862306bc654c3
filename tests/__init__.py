"""The test suite, a package so that its folders may hold modules of the same name: the folders
mirror the package (ops/dilated, ops/block_sparse, ops/ring, ops/common, integrations, perf),
plus serve/ (the serve doors and caches), modules/ and repo/ (pages, ./dev, notebooks, the
package's shape). Shared code lives in helpers/ only; no test module imports another
(repo/test_structure.py checks both)."""
