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
#include <utility>
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

// Stores `value` through the Reflection setter of the field's kind: appended to a repeated
// field when `index` is -1, at `index` of it otherwise, or set on a singular field.
template <typename T>
void store(Message& message, const FieldDescriptor* field, int index, T value,
           void (Reflection::*add)(Message*, const FieldDescriptor*, T) const,
           void (Reflection::*set_repeated)(Message*, const FieldDescriptor*, int, T) const,
           void (Reflection::*set)(Message*, const FieldDescriptor*, T) const) {
  const Reflection* r = message.GetReflection();
  if (!field->is_repeated()) {
    (r->*set)(&message, field, std::move(value));
  } else if (index < 0) {
    (r->*add)(&message, field, std::move(value));
  } else {
    (r->*set_repeated)(&message, field, index, std::move(value));
  }
}

// Sets `field` of `message` (an element of it when repeated: `index`, or a new one at -1).
inline void set_edge(Message& message, const FieldDescriptor* field, int index, std::mt19937& rng) {
  switch (field->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      store(message, field, index, static_cast<int32_t>(edge_integer(rng)), &Reflection::AddInt32,
            &Reflection::SetRepeatedInt32, &Reflection::SetInt32);
      break;
    case FieldDescriptor::CPPTYPE_INT64:
      store(message, field, index, edge_integer(rng), &Reflection::AddInt64,
            &Reflection::SetRepeatedInt64, &Reflection::SetInt64);
      break;
    case FieldDescriptor::CPPTYPE_UINT32:
      store(message, field, index, static_cast<uint32_t>(edge_integer(rng)), &Reflection::AddUInt32,
            &Reflection::SetRepeatedUInt32, &Reflection::SetUInt32);
      break;
    case FieldDescriptor::CPPTYPE_UINT64:
      store(message, field, index, static_cast<uint64_t>(edge_integer(rng)), &Reflection::AddUInt64,
            &Reflection::SetRepeatedUInt64, &Reflection::SetUInt64);
      break;
    case FieldDescriptor::CPPTYPE_FLOAT:
      store(message, field, index, static_cast<float>(edge_real(rng)), &Reflection::AddFloat,
            &Reflection::SetRepeatedFloat, &Reflection::SetFloat);
      break;
    case FieldDescriptor::CPPTYPE_DOUBLE:
      store(message, field, index, edge_real(rng), &Reflection::AddDouble,
            &Reflection::SetRepeatedDouble, &Reflection::SetDouble);
      break;
    case FieldDescriptor::CPPTYPE_BOOL:
      store(message, field, index, rng() % 2 == 0, &Reflection::AddBool,
            &Reflection::SetRepeatedBool, &Reflection::SetBool);
      break;
    case FieldDescriptor::CPPTYPE_ENUM: {
      // A named value, or a number the proto does not name (proto3 enums are open).
      const google::protobuf::EnumDescriptor* type = field->enum_type();
      const int value = rng() % 2 == 0
                            ? type->value(static_cast<int>(rng() % type->value_count()))->number()
                            : static_cast<int>(rng() % 8) - 2 + type->value_count();
      store(message, field, index, value, &Reflection::AddEnumValue,
            &Reflection::SetRepeatedEnumValue, &Reflection::SetEnumValue);
      break;
    }
    case FieldDescriptor::CPPTYPE_STRING:
      store(message, field, index, edge_string(rng), &Reflection::AddString,
            &Reflection::SetRepeatedString, &Reflection::SetString);
      break;
    case FieldDescriptor::CPPTYPE_MESSAGE:
      // A repeated message gains an element; a singular one is set (and, in a oneof, chosen).
      // An element's own fields are mutated as fields of their own (collect()).
      if (!field->is_repeated()) {
        message.GetReflection()->MutableMessage(&message, field);
      } else if (index < 0) {
        message.GetReflection()->AddMessage(&message, field);
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
    case 1:  // change one (a message element: nothing here, its fields are picked on their own)
      set_edge(owner, pick.field, static_cast<int>(rng() % size), rng);
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
