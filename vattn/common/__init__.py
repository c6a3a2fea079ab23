"""What every layer of vattn shares: its exceptions, byte sizes, the cache's
configuration, argument checks and the install check. Nothing here calls the
extension; docs/design.md section 1."""
