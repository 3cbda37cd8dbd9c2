"""What every test layer shares: process helpers, the network-namespace harness, worker scripts
run by path (``support/workers``) and the helpers of tests that used to import one another."""
