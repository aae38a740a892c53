"""A module in the adapter package that lacks SUMMARY/build (registry tests)."""
