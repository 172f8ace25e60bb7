"""The test suite, a package so that test files are named by their folder (tests.kernels.test_kernels, ...)
and import the shared helpers as tests.helpers.*."""
