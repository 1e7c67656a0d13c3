// libprotobuf's own log lines, routed through spdlog and rate limited. A client controls what
// libprotobuf logs about the messages it sends (a string field with invalid UTF-8 logs an error
// on every parse), so without a limit any client could write to the server's log at will.
#pragma once

namespace deft::server {

// Installs the handler (once, before the server takes calls: libprotobuf's SetLogHandler is
// not thread-safe). Each source line of libprotobuf logs at most once a minute, with the count
// of lines it held back since; a FATAL line is always written.
void route_protobuf_logs();

// True when libprotobuf logged an error on the calling thread since the last call (which
// clears it). gRPC's synchronous API parses a received message on the thread that reads it, so
// a handler whose Read() returned false can tell a message that failed to parse (invalid UTF-8
// in a string field) from the client's half-close.
bool take_protobuf_parse_error();

}  // namespace deft::server
