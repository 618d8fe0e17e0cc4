// Catch2 (v2, the Debian package) provides main().
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
