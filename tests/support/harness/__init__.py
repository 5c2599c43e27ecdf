"""What only the tests need to run the daemon and its workers."""
