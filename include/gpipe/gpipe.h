// gpipe.h — umbrella header: everything a LibTorch user needs to pipeline a Sequential.
#pragma once

#include <gpipe/balance.h>
#include <gpipe/distributed_pipe.h>
#include <gpipe/error.h>
#include <gpipe/options.h>
#include <gpipe/phase.h>
#include <gpipe/pipe.h>
#include <gpipe/process_group.h>
#include <gpipe/skip.h>
#include <gpipe/trace.h>
