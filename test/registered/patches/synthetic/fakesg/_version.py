__version__ = version = '0.5.17'
