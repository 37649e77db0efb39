"""The test suite; a regular package so that ``tests.*`` resolves here, not to the top-level
``tests`` package that the verl wheel installs into site-packages."""
