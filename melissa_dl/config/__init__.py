"""The study configuration, plain data at the ground of the package: its sections (``sections``), the kinds it
chooses by name (``registry``) and the bounds the clients accept (``limits``); it imports no wing."""
