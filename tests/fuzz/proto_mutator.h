// A structure-aware mutation of a protobuf message through its reflection, for the libFuzzer
// harnesses whose input holds request encodings (Debian has no libprotobuf-mutator): one field,
// picked at random among the fields of the message and of its set sub-messages, gets an edge
// value of its type (0, -1, the int32 and int64 limits, NaN and infinities, an empty or long
// string, an enum number the proto does not name, a random bool), or is cleared; a repeated
// field gets an element added, changed or removed, or grows; a sub-message is set or cleared.
// Byte mutations of an encoding mostly break it; these keep it a request and move one value to
// where validation has to hold.
#pragma once

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace deft::fuzz {

namespace proto_mutator_detail {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

struct FieldRef {
  Message* message;
  const FieldDescriptor* field;
};

// Deeper sub-messages are reached by byte mutations, which suffice for their few fields.
constexpr int kMaxDepth = 6;

inline void collect(Message& message, int depth, std::vector<FieldRef>* fields) {
  const google::protobuf::Descriptor* descriptor = message.GetDescriptor();
  const Reflection* reflection = message.GetReflection();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const FieldDescriptor* field = descriptor->field(i);
    fields->push_back({&message, field});
    if (depth >= kMaxDepth || field->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE) continue;
    if (field->is_repeated()) {
      for (int e = 0; e < reflection->FieldSize(message, field); ++e) {
        collect(*reflection->MutableRepeatedMessage(&message, field, e), depth + 1, fields);
      }
    } else if (reflection->HasField(message, field)) {
      collect(*reflection->MutableMessage(&message, field), depth + 1, fields);
    }
  }
}

inline int64_t edge_integer(std::mt19937& rng) {
  static constexpr int64_t kValues[] = {0,
                                        1,
                                        -1,
                                        2,
                                        16,
                                        std::numeric_limits<int32_t>::max(),
                                        std::numeric_limits<int32_t>::min(),
                                        int64_t{std::numeric_limits<int32_t>::max()} + 1,
                                        std::numeric_limits<int64_t>::max(),
                                        std::numeric_limits<int64_t>::min()};
  if (rng() % 4 == 0) return static_cast<int64_t>(rng() % 1000);
  return kValues[rng() % std::size(kValues)];
}

inline double edge_real(std::mt19937& rng) {
  static constexpr double kValues[] = {0.0,
                                       -1.0,
                                       0.5,
                                       1.0,
                                       2.5,
                                       1e30,
                                       -0.0,
                                       std::numeric_limits<double>::quiet_NaN(),
                                       std::numeric_limits<double>::infinity(),
                                       -std::numeric_limits<double>::infinity()};
  return kValues[rng() % std::size(kValues)];
}

// Valid UTF-8 only: a proto3 string that is not would fail the harness's own parse before it is
// sent (what the server does with such bytes is the byte mutations' to reach).
inline std::string edge_string(std::mt19937& rng) {
  switch (rng() % 4) {
    case 0:
      return "";
    case 1:
      return "Once";
    case 2:
      return std::string(1 + rng() % 2048, 'a');
    default:
      return std::string(1, static_cast<char>('a' + rng() % 26));
  }
}

// Sets `field` of `message` (an element of it when repeated: `index`, or a new one at -1).
inline void set_edge(Message& message, const FieldDescriptor* field, int index, std::mt19937& rng) {
  const Reflection* r = message.GetReflection();
  const bool add = field->is_repeated() && index < 0;
  const bool set = field->is_repeated() && index >= 0;
  switch (field->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32: {
      const auto v = static_cast<int32_t>(edge_integer(rng));
      add   ? r->AddInt32(&message, field, v)
      : set ? r->SetRepeatedInt32(&message, field, index, v)
            : r->SetInt32(&message, field, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_INT64: {
      const int64_t v = edge_integer(rng);
      add   ? r->AddInt64(&message, field, v)
      : set ? r->SetRepeatedInt64(&message, field, index, v)
            : r->SetInt64(&message, field, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_UINT32: {
      const auto v = static_cast<uint32_t>(edge_integer(rng));
      add   ? r->AddUInt32(&message, field, v)
      : set ? r->SetRepeatedUInt32(&message, field, index, v)
            : r->SetUInt32(&message, field, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_UINT64: {
      const auto v = static_cast<uint64_t>(edge_integer(rng));
      add   ? r->AddUInt64(&message, field, v)
      : set ? r->SetRepeatedUInt64(&message, field, index, v)
            : r->SetUInt64(&message, field, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_FLOAT: {
      const auto v = static_cast<float>(edge_real(rng));
      add   ? r->AddFloat(&message, field, v)
      : set ? r->SetRepeatedFloat(&message, field, index, v)
            : r->SetFloat(&message, field, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_DOUBLE: {
      const double v = edge_real(rng);
      add   ? r->AddDouble(&message, field, v)
      : set ? r->SetRepeatedDouble(&message, field, index, v)
            : r->SetDouble(&message, field, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_BOOL: {
      const bool v = rng() % 2 == 0;
      add   ? r->AddBool(&message, field, v)
      : set ? r->SetRepeatedBool(&message, field, index, v)
            : r->SetBool(&message, field, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_ENUM: {
      // A named value, or a number the proto does not name (proto3 enums are open).
      const google::protobuf::EnumDescriptor* type = field->enum_type();
      const int v = rng() % 2 == 0
                        ? type->value(static_cast<int>(rng() % type->value_count()))->number()
                        : static_cast<int>(rng() % 8) - 2 + type->value_count();
      add   ? r->AddEnumValue(&message, field, v)
      : set ? r->SetRepeatedEnumValue(&message, field, index, v)
            : r->SetEnumValue(&message, field, v);
      break;
    }
    case FieldDescriptor::CPPTYPE_STRING: {
      std::string v = edge_string(rng);
      add   ? r->AddString(&message, field, std::move(v))
      : set ? r->SetRepeatedString(&message, field, index, std::move(v))
            : r->SetString(&message, field, std::move(v));
      break;
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      if (add) {
        r->AddMessage(&message, field);
      } else if (!set) {
        r->MutableMessage(&message, field);  // set (and, in a oneof, chosen)
      }
      break;
  }
}

}  // namespace proto_mutator_detail

// One mutation of `message` (see the file comment).
inline void mutate_message(google::protobuf::Message& message, std::mt19937& rng) {
  using namespace proto_mutator_detail;
  std::vector<FieldRef> fields;
  collect(message, 0, &fields);
  if (fields.empty()) return;
  const FieldRef pick = fields[rng() % fields.size()];
  Message& owner = *pick.message;
  const Reflection* r = owner.GetReflection();
  if (rng() % 6 == 0) {
    r->ClearField(&owner, pick.field);
    return;
  }
  if (!pick.field->is_repeated()) {
    set_edge(owner, pick.field, -1, rng);
    return;
  }
  const int size = r->FieldSize(owner, pick.field);
  switch (size == 0 ? 0 : rng() % 4) {
    case 0:  // add
      set_edge(owner, pick.field, -1, rng);
      break;
    case 1:  // change one
      if (pick.field->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE) {
        set_edge(owner, pick.field, static_cast<int>(rng() % size), rng);
      }
      break;
    case 2:  // remove the last
      r->RemoveLast(&owner, pick.field);
      break;
    default:  // grow: copies of its messages, edge values of a scalar (at most 64 elements)
      for (int e = 0; e < size && size + e < 64; ++e) {
        if (pick.field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
          r->AddMessage(&owner, pick.field)->CopyFrom(r->GetRepeatedMessage(owner, pick.field, e));
        } else {
          set_edge(owner, pick.field, -1, rng);
        }
      }
      break;
  }
}

}  // namespace deft::fuzz
