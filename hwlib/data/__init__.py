"""Data sets and loaders: synthetic and file token streams (``tokens``), images (``images``), NLI
pairs and packing (``nli``), and the loader modes the ladder's step 08 measures (``loader``)."""
