// main.cpp — the Catch2 (v2) test runner's main(); the tests live in the other files here.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
